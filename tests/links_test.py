#!/usr/bin/env python3
"""The docs' links lead somewhere: every relative link of README.md, BENCHMARKS.md and docs/*.md
must name a file or directory of the repository, and a link with an anchor (#heading) into one of
those pages must name one of its headings, as GitHub makes anchors from headings: lowercase,
punctuation other than '-' and '_' removed, each space a '-', and a heading that repeats an
earlier one's anchor gets -1, -2, ... Links to other files' anchors (e.g. source lines) are only
checked for the file. External links (http:, https:, mailto:) are not fetched: there is no
network here; they are counted.

usage: links_test.py SOURCE_DIR        exit 1 naming FILE:LINE and the link of each broken one
"""
import glob
import os
import re
import sys
import unicodedata

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages(src):
    found = [os.path.join(src, "README.md"), os.path.join(src, "BENCHMARKS.md")]
    found += sorted(glob.glob(os.path.join(src, "docs", "*.md")))
    return [p for p in found if os.path.isfile(p)]


def prose_lines(text):
    """(line number, line) for every line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text (github-slugger)."""
    text = CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    out = []
    for ch in text.lower():
        if ch in "-_ " or unicodedata.category(ch)[0] in "LN":
            out.append(ch)
    return "".join(out).replace(" ", "-")


def anchors(path):
    seen = set()
    counts = {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        name = base
        while name in seen:
            counts[base] = counts.get(base, 0) + 1
            name = f"{base}-{counts[base]}"
        seen.add(name)
    return seen


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().split("\n")[-1], file=sys.stderr)
        return 2
    src = os.path.abspath(sys.argv[1])
    checked = pages(src)
    cache = {}
    broken = links = external = 0
    for page in checked:
        rel_page = os.path.relpath(page, src)
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for number, line in prose_lines(text):
            for m in LINK.finditer(CODE_SPAN.sub("", line)):
                target = m.group(1)
                links += 1
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    external += 1
                    continue
                path, _, anchor = target.partition("#")
                where = page
                if path:
                    where = os.path.normpath(os.path.join(os.path.dirname(page), path))
                problem = None
                if not (where == src or where.startswith(src + os.sep)):
                    problem = "leaves the repository"
                elif not os.path.exists(where):
                    problem = f"{os.path.relpath(where, src)} does not exist"
                elif anchor and where.endswith(".md") and where in checked:
                    if where not in cache:
                        cache[where] = anchors(where)
                    if anchor not in cache[where]:
                        problem = (f"{os.path.relpath(where, src)} has no heading with the "
                                   f"anchor #{anchor}")
                if problem:
                    broken += 1
                    print(f"FAIL {rel_page}:{number}: ({target}): {problem}")
    names = ", ".join(os.path.relpath(p, src) for p in checked)
    print(f"docs_links: {links} links in {len(checked)} pages ({names}); {external} external, "
          f"not fetched; {broken} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
