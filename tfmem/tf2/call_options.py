"""Call options of partition functions: the caller's, with Grappler's memory optimizer off.

An eager function is optimized by Grappler when first called, with the config
its call carries (`context.function_call_options`).  The memory optimizer's
scheduling pass rewrites a sum of more than two tensors (AddN) whenever its
static estimate of the function passes 80 % of the device's memory attribute
(256 MiB for every CPU device, the emulated accelerator's too):

    AddN(a, b, c)  -->  tmp_var = TemporaryVariable   (allocated before a, b, c exist)
                        zeros   = ZerosLike(a)         (folded into a Const)
                        Assign(tmp_var, zeros); AssignAdd(tmp_var, a) ... ; Destroy

The folded Const is a tensor of the sum's size that the function's kernel holds
for as long as the function lives: a Keras ResNet-50 at batch 256 kept 64 MiB
on the device for each partition so rewritten, which no plan accounts for, and
its first step ran out of device memory.  tfmem places every tensor itself, so
its partition functions are instantiated without that pass; the rest of the
caller's config (other Grappler passes, placement, threads) is kept, and
nothing outside tfmem's calls sees a change.
"""

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

_NO_MEMORY_OPTIMIZER = {}  # (caller's config bytes, executor type) -> FunctionCallOptions


def _without_memory_optimizer(options):
    """`options` (a FunctionCallOptions) with Grappler's memory optimizer off."""
    key = (options.config_proto_serialized, options.executor_type)
    ours = _NO_MEMORY_OPTIMIZER.get(key)
    if ours is None:
        config = config_pb2.ConfigProto()
        if options.config_proto_serialized:
            config.ParseFromString(options.config_proto_serialized)
        config.graph_options.rewrite_options.memory_optimization = (
            rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)
        ours = _NO_MEMORY_OPTIMIZER[key] = context.FunctionCallOptions(
            executor_type=options.executor_type, config_proto=config)
    return ours


def call_without_memory_optimizer(call, args):
    """`call(*args)` (an eager function call) with the calling thread's function-call
    options replaced by `_without_memory_optimizer` of them for the call's duration."""
    ctx = context.context()
    caller = ctx.function_call_options  # what every eager function call reads
    ctx.function_call_options = _without_memory_optimizer(caller)
    try:
        return call(*args)
    finally:
        ctx.function_call_options = caller
