// fsdp/fsdp.h: everything a program needs to shard a libtorch model.
//
//   #include <fsdp/fsdp.h>
//   auto model = fsdp::shard(std::make_shared<NetImpl>(),
//                            fsdp::FSDPStrategy().sharding_strategy("HYBRID_SHARD")
//                                                .device_mesh({2, 4}));
#pragma once

#include "fsdp/activation_checkpoint.h"
#include "fsdp/async_checkpoint.h"
#include "fsdp/backend.h"
#include "fsdp/checkpoint.h"
#include "fsdp/cluster.h"
#include "fsdp/collectives.h"
#include "fsdp/dcp.h"
#include "fsdp/deferred_init.h"
#include "fsdp/error.h"
#include "fsdp/launcher.h"
#include "fsdp/memory.h"
#include "fsdp/mesh.h"
#include "fsdp/parse_enum.h"
#include "fsdp/planner.h"
#include "fsdp/process.h"
#include "fsdp/report.h"
#include "fsdp/runtime.h"
#include "fsdp/runtime_options.h"
#include "fsdp/sharded.h"
#include "fsdp/strategy.h"
#include "fsdp/trace.h"
