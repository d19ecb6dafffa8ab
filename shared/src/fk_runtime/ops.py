"""One helper that defines a differentiable fk op: `define(...)`.

It registers the `torch.library` op (`fk::<name>`) with its fake, the backward op
(`fk::<name>_backward`) with its fake, the autograd formula on the registered op, and an
`autograd.Function` with `setup_context` and a `vmap` rule (so `torch.func.grad`, `vmap`, `jacrev`
and `vjp` work), and returns the callable the op's public function uses:

- eager calls run the `autograd.Function` straight into the implementation: a registered op's
  dispatcher costs tens of microseconds on the host, more than a memory-bound kernel on a few MB
  takes on the GPU;
- a call that autograd does not record (inference, no_grad) can skip even that: an op keys it on
  `quiet_key` (its inputs' layouts and its other arguments with their types) and keeps, once the
  checks passed, the call's bound plan under that key in its plan cache; a call that autograd
  records keeps, under its own key, the `autograd.Function` call its checks resolved to, around the
  forward bound for that key (`Op.bound`: no plan looked up again);
- under `torch.compile` (or when a tracer hands in fake or functional tensors) Dynamo traces the
  same `autograd.Function`, whose forward and backward then call the registered ops: opaque in
  the graph, with the fakes for shapes, and the same kernels at run time.

Gradients are first-order only: the backward kernels are not differentiable themselves. When
autograd records the backward (`create_graph=True`, e.g. for a gradient penalty), the gradients
carry a node on the backward's real inputs (x, weight, the upstream gradient) that raises if
anything differentiates through them, also `autograd.grad(penalty, [weight])`; the registered
backward op raises the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch

# Tensor types the implementation may touch directly (data pointers, strides of real memory).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_forward_ad = torch.autograd.forward_ad


def _forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (dual tensors are plain tensors to look at)."""
    return getattr(_forward_ad, "_current_level", -1) >= 0


def transforms_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev, ...) is running."""
    return _functorch_active()


def traced(args) -> bool:
    """Whether a tracer runs: Dynamo says so; AOTAutograd tracing a registered backward does not,
    but its tensors are fake / functional subclasses, which send the call to the registered op."""
    if torch.compiler.is_compiling():
        return True
    for a in args:
        kind = type(a)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if a.is_meta:  # shapes only (a model on the meta device): the registered op's fake
                return True
        elif isinstance(a, torch.Tensor):
            return True
    return False


def resolve_negated(args) -> tuple:
    """`args` with lazily negated views (`x.is_neg()`: `t.conj().imag`, `torch._neg_view`) made real
    tensors: the kernels read memory as stored, and would compute on -x. The dispatcher does this
    for the registered ops; eager calls skip it."""
    return tuple(a.resolve_neg() if isinstance(a, torch.Tensor) and a.is_neg() else a for a in args)


_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)


_AUTOCAST_FROM = (torch.float32, torch.float16, torch.bfloat16)
# One call for "no autocast anywhere" (the usual case), before the per-device question.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast(*tensors) -> tuple:
    """`tensors` as torch's autocast hands them to its lower-precision ops (matmuls, SDPA): under
    `torch.autocast` for the first tensor's device, every fp32/fp16/bf16 tensor in autocast's dtype;
    otherwise (or for non-tensors, fp8 and the like) as given."""
    if not _any_autocast():
        return tensors
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_FROM else t for t in tensors)


# Argument values a quiet call's key may hold: compared by type and value, so that a value the
# checks would refuse (1.0 for an int, say) never meets a plan bound for an accepted one.
_KEY_VALUES = frozenset((type(None), bool, int, float, str))


_NO_KEY = (None, None)


def quiet_run(cache, name: str, tensors: tuple, values: tuple, more=None) -> tuple:
    """A public function's first step: (key, run), the call's `quiet_key` and what `cache` (the
    op's PlanCache) keeps under it. A run: the call's whole answer is `run(*tensors)`. None: the
    call takes the op's full path, and once it passed the checks `keep_quiet(cache, key, build)`.
    `cache` None: (key, None). `more`: a callable giving further values of the key, called only for a
    plain eager call (facts a tracer may not read, such as inference mode). (The key is computed
    here, not by calling `quiet_key`: one Python call less on every call.)"""
    if _any_autocast() or _functorch_active() or torch.compiler.is_compiling() or _forward_ad_active():
        return _NO_KEY
    facts = []
    for t in tensors:
        if t is None:
            facts.append(None)
            continue
        kind = type(t)
        if (kind is not torch.Tensor and kind is not torch.nn.Parameter) or t.is_neg() or t.is_meta:
            return _NO_KEY
        try:
            facts.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
        except RuntimeError:  # sparse or nested: no strides or sizes (the op's checks refuse them)
            return _NO_KEY
    if more is not None:
        values = (*values, *more())
    kinds = tuple(map(type, values))
    if not _KEY_VALUES.issuperset(kinds):
        typed = []
        for kind, value in zip(kinds, values, strict=True):
            if kind is tuple or kind is list:
                inner = tuple(map(type, value))
                if not _KEY_VALUES.issuperset(inner):
                    return _NO_KEY
                value = (tuple(value), inner)
            elif kind not in _KEY_VALUES:
                return _NO_KEY
            typed.append(value)
        values = tuple(typed)
    key = name, tuple(facts), values, kinds, torch.is_grad_enabled()
    return key, cache.get(key) if cache else None  # (an empty cache holds nothing either)


def keep_quiet(cache, key, build, recorded=None):
    """The run a call's key keeps, built once after a call of that key passed the checks: `build()`
    for a call autograd does not record, `recorded()` for one it records (the op's autograd.Function
    call with the arguments resolved; none given: nothing kept). None where there is no key or the
    builder gave a falsy value (that key's calls then take the full path every time)."""
    if key is not None and _recorded(key):
        build = recorded
    if key is None or build is None:
        return None
    return cache.get_or_build(key, build) or None


def _recorded(key) -> bool:
    """Whether autograd records the calls of `key`: grad mode on, an input that requires grad."""
    return key[-1] and any(fact is not None and fact[-1] for fact in key[1])


def quiet_key(name: str, tensors: tuple, values: tuple) -> tuple | None:
    """The key of a plain eager call, under which an op may keep what the call resolves to (checks
    passed, arguments parsed, the bound plan or the autograd.Function call): `name`, each tensor's
    (shape, strides, dtype, device, requires_grad) (None stays None), each value with its type, and
    last the grad mode (with the requires_grad flags: whether autograd records the call). None for
    any other call, which then takes the op's full path: traced or under torch.func, forward-mode
    AD or autocast on, tensor subclasses, lazily negated views, meta, sparse or nested tensors,
    values other than None, bools, ints, floats, strings and tuples or lists of them."""
    return quiet_run(None, name, tensors, values)[0]


def _own(outputs, inputs):
    """Outputs that are views of buffers made inside the op (a (B, N, H, D) buffer seen as
    (B, H, N, D), a row of a partial-sum buffer) as tensors of their own, same storage and strides:
    autograd refuses in-place changes of a custom Function's view outputs, which torch's own ops
    allow. Views of an input stay views (autograd must see that aliasing)."""
    if isinstance(outputs, tuple):
        if not any(o._is_view() for o in outputs if isinstance(o, torch.Tensor)):
            return outputs
        return tuple(_own(o, inputs) if isinstance(o, torch.Tensor) else o for o in outputs)
    if not outputs._is_view():
        return outputs
    base = outputs._base
    if any(isinstance(i, torch.Tensor) and (base is i or base is i._base) for i in inputs):
        return outputs
    return outputs.detach()


def _distinct(inputs) -> tuple:
    """`inputs` with a tensor passed a second time replaced by an alias view of it: Dynamo refuses
    one tensor as two inputs of an autograd.Function (one tensor given for two operands)."""
    seen = []
    out = []
    for a in inputs:
        if isinstance(a, torch.Tensor):
            if any(a is s for s in seen):
                a = a.view_as(a)
            else:
                seen.append(a)
        out.append(a)
    return tuple(out)


def not_differentiable_message(name: str) -> str:
    return (f"{name} computes first-order gradients only: differentiating through them "
            "(create_graph=True and a second backward, e.g. a gradient penalty) is not supported")


def _slice_rule(apply):
    """A vmap rule for any op: the op on each slice of the batch, the results stacked on dim 0."""

    def rule(info, in_dims, *args):
        # Only tensors carry a batch dim (a list argument's in_dims entry is a list of Nones).
        in_dims = [d if isinstance(a, torch.Tensor) else None for a, d in zip(args, in_dims, strict=True)]
        if info.batch_size == 0:  # nothing to run: one slice of zeros gives the results' shapes, none kept
            probe = apply(*[a if d is None else a.new_zeros(a.shape[:d] + a.shape[d + 1:])
                            for a, d in zip(args, in_dims, strict=True)])
            if not isinstance(probe, tuple):
                return probe.new_empty((0, *probe.shape)), 0
            return tuple(p.new_empty((0, *p.shape)) for p in probe), (0,) * len(probe)
        results = [apply(*[a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)])
                   for i in range(info.batch_size)]
        if not isinstance(results[0], tuple):
            return torch.stack(results), 0
        stacked = tuple(torch.stack(parts) for parts in zip(*results, strict=True))
        return stacked, (0,) * len(stacked)

    return rule


@dataclasses.dataclass(frozen=True)
class Op:
    """What `define` hands back: `apply` is the differentiable call; `op` and `backward_op` are
    the registered `torch.ops.fk.*` ops; `function` the autograd.Function; `recorded` the eager
    Function's apply itself, for a call that `quiet_key` found recorded (plain tensors, no transform,
    tracer or forward-mode AD: what `apply` would look for again); `bound(run, *inputs)` the same
    with `run` on the leading `bound_inputs` inputs for the implementation: the forward that such a
    call's key bound once."""

    apply: Callable
    op: object
    backward_op: object
    function: type
    recorded: Callable
    bound: Callable


def define(
    name: str,
    *,
    forward: Callable,
    forward_fake: Callable,
    backward: Callable,
    backward_fake: Callable,
    save: Callable,
    backward_args: Callable,
    input_grads: Callable,
    non_differentiable: tuple[int, ...] = (),
    materialize_grads: bool = True,
    vmap: Callable | None = None,
    bound_inputs: int | None = None,
) -> Op:
    """Define `fk::<name>` and its backward.

    forward(*inputs) -> output or tuple of outputs: the eager implementation, annotated for
    `torch.library.custom_op`'s schema; forward_fake the same signature for shapes.
    backward(*args) -> tuple of tensors; backward_fake likewise (`fk::<name>_backward`).
    save(inputs, outputs) -> (tensors to save, anything else backward needs).
    backward_args(saved tensors, other, grads, needs_input_grad) -> args of `backward` (which may
    skip the gradients no input needs).
    input_grads(other, backward outputs, needs_input_grad) -> one gradient (or None) per input.
    non_differentiable: indexes of outputs without gradients (statistics, say).
    materialize_grads: False hands `backward_args` None for unused outputs' gradients.
    vmap: an `autograd.Function` vmap rule `(info, in_dims, *inputs)`; by default the op runs on
    each slice of the batch.
    bound_inputs: how many leading inputs a bound forward takes (`Op.bound`; None: all of them).
    """
    qualified = f"fk::{name}"
    backward_name = f"{qualified}_backward"

    backward_op = torch.library.custom_op(backward_name, backward, mutates_args=())
    backward_op.register_fake(backward_fake)

    def _raise(ctx, *grads):
        raise RuntimeError(not_differentiable_message(backward_name))

    backward_op.register_autograd(_raise)

    class BackwardFunction(torch.autograd.Function):
        """The backward kernels as a node of their own: a second backward through it raises."""

        @staticmethod
        def forward(*args):
            return backward(*args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, *grads):
            raise RuntimeError(not_differentiable_message(backward_name))

        @staticmethod
        def vmap(info, in_dims, *args):
            return _slice_rule(BackwardFunction.apply)(info, in_dims, *args)

    traced_backward = getattr(torch.ops.fk, f"{name}_backward").default

    def run_backward(*args):
        if traced(args):
            return traced_backward(*args)
        if not torch.is_grad_enabled() and not _functorch_active():
            return backward(*args)
        return BackwardFunction.apply(*args)

    def setup_context(ctx, inputs, output):
        outputs = output if isinstance(output, tuple) else (output,)
        tensors, other = save(inputs, outputs)
        ctx.save_for_backward(*tensors)
        ctx.fk_other = other
        if non_differentiable:
            ctx.mark_non_differentiable(*(outputs[i] for i in non_differentiable))
        if not materialize_grads:
            ctx.set_materialize_grads(False)

    def compute_grads(ctx, *grads):
        return grads_of(ctx, grads, ctx.needs_input_grad)

    def grads_of(ctx, grads, needs):
        # The upstream gradients are the backward's only inputs that did not pass the forward's checks.
        negated = False
        for g in () if torch.compiler.is_compiling() else grads:  # (traced: the registered ops see them)
            if g is not None:
                if _is_legacy_batched(g):
                    raise RuntimeError(f"{backward_name} does not run under autograd's legacy vmap "
                                       "(`autograd.grad(..., is_grads_batched=True)`, "
                                       "`autograd.functional.jacobian(..., vectorize=True)`): use torch.func "
                                       "(`vmap` over `vjp`, `jacrev`), which fk ops support")
                negated = negated or g.is_neg()
        if negated:
            grads = resolve_negated(grads)
        args = backward_args(ctx.saved_tensors, ctx.fk_other, grads, needs)
        return tuple(input_grads(ctx.fk_other, run_backward(*args), needs))

    op = torch.library.custom_op(qualified, forward, mutates_args=())
    op.register_fake(forward_fake)
    op.register_autograd(compute_grads, setup_context=setup_context)

    traced_op = getattr(torch.ops.fk, name).default  # what Dynamo can put in a graph

    def run_forward(*inputs):
        if traced(inputs):
            return traced_op(*inputs)
        inputs = resolve_negated(inputs)
        return _own(forward(*inputs), inputs)

    def recorded_forward(*inputs):  # what autograd records in eager calls
        return _own(forward(*inputs), inputs)

    # The same with the forward a key bound once in front of the inputs (`Op.bound`): no lookups a call.
    def bound_forward(run, *inputs):
        return _own(run(*inputs[:bound_inputs]), inputs)

    def bound_setup_context(ctx, inputs, output):
        setup_context(ctx, inputs[1:], output)

    def bound_grads(ctx, *grads):
        return None, *grads_of(ctx, grads, ctx.needs_input_grad[1:])

    # The implementation's parameters: Dynamo passes `ctx` to a forward whose parameter count differs
    # from the inputs' (a `*inputs` forward took it as its first input when nothing required grad).
    run_forward.__signature__ = recorded_forward.__signature__ = inspect.signature(forward)

    def make_function(forward_fn, kind: str, setup=setup_context, grads=compute_grads):
        cls = type(f"{name.title().replace('_', '')}{kind}Function", (torch.autograd.Function,), {
            "__doc__": f"Autograd for {qualified}: setup_context, backward, vmap.",
            "forward": staticmethod(forward_fn),
            "setup_context": staticmethod(setup),
            "backward": staticmethod(grads),
        })
        cls.vmap = staticmethod(vmap or _slice_rule(cls.apply))
        return cls

    # Traced calls and torch.func transforms take torch's Function.apply into a forward that picks
    # the registered op or the implementation. Plain eager calls skip both: the implementation
    # runs at once when autograd records nothing, else through the C++ apply (torch's Python
    # apply binds the arguments through inspect.signature when setup_context is defined: tens of
    # microseconds a call).
    function = make_function(run_forward, "")
    eager = make_function(recorded_forward, "Eager")
    c_apply = super(torch.autograd.Function, eager).apply
    bound = make_function(bound_forward, "Bound", bound_setup_context, bound_grads)

    def apply(*inputs):
        # torch.func, compiling and forward-mode AD take torch's own apply (the last raises: no jvp).
        if _functorch_active() or torch.compiler.is_compiling() or _forward_ad_active():
            if torch.compiler.is_exporting():  # strict export keeps the registered op's autograd, not a Function's
                return op(*inputs)
            if torch.compiler.is_compiling():
                inputs = _distinct(inputs)
            return function.apply(*inputs)
        grad_mode = torch.is_grad_enabled()
        records = False
        for a in inputs:  # one pass: traced tensors (fake, functional) and inputs requiring grad
            kind = type(a)
            if kind is torch.Tensor or kind is torch.nn.Parameter:
                if a.is_neg():
                    return apply(*resolve_negated(inputs))
                if a.is_meta:  # shapes only: the registered op's fake, through torch's apply
                    return function.apply(*inputs)
                records = records or (grad_mode and a.requires_grad)
            elif isinstance(a, torch.Tensor):
                return function.apply(*inputs)
        return c_apply(*inputs) if records else _own(forward(*inputs), inputs)

    apply.__name__ = name
    return Op(apply, op, backward_op, function, c_apply, super(torch.autograd.Function, bound).apply)
