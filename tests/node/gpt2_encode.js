// The reference for fsdp-tokenize: npm gpt-3-encoder's own encode() (OpenAI's GPT-2 encoder.py
// ported to JavaScript) on a file, printed as one JSON array of ids.
// usage: node gpt2_encode.js PACKAGE_DIR FILE
// gpt-3-encoder's encode() concatenates its output array once per piece (quadratic: ~7 minutes
// for 400 KiB here), so the text is encoded in chunks cut where GPT-2's pattern always cuts: after
// a newline that follows a non-space and precedes a non-space ("x\ny": "\n" is a piece of its own
// in the whole text and ends a chunk the same way).
const fs = require('fs');
const { encode } = require(process.argv[2]);
const text = fs.readFileSync(process.argv[3], 'utf8');
const ids = [];
let start = 0;
const isSpace = c => /\s/u.test(c);
for (let i = 2; i <= text.length; i++) {
  const cut = i === text.length ||
      (text[i - 1] === '\n' && !isSpace(text[i - 2]) && !isSpace(text[i]) && i - start > 4096);
  if (!cut) continue;
  for (const id of encode(text.slice(start, i))) ids.push(id);
  start = i;
}
console.log(JSON.stringify(ids));
