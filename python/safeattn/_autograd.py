"""Autograd of the softmax ops: reverse mode (double backward included), forward mode
(``torch.autograd.forward_ad``, ``torch.func.jvp``) and the ``torch.func`` transforms.

Each of the four softmax ops (``safe_softmax``, ``masked_softmax`` and their private backward ops)
gets an Autograd kernel here that applies a Function with ``setup_context``, ``backward`` and
``jvp``, and a vmap rule (``torch.library.register_vmap``). Every formula is written with the
fused ops themselves (or a few ATen ops), so no transform decomposes the kernels: the softmax
Jacobian ``J = diag(y) - y y^T`` is symmetric, so the tangent of ``y = softmax(x)`` is the
backward op applied to the input's tangent, ``J t``. Second derivatives go through the backward
ops' own Functions.

Why not ``torch.library.register_autograd``: the Function it generates has no ``setup_context``
(``torch.func`` refuses it) and no ``jvp`` (forward AD got a zero tangent without a word), and
torch 2.14's custom-op API has no way to add a jvp.

Why ``_SingleLevelFunction`` and not ``torch.autograd.Function``: under a ``torch.func`` transform
an ``autograd.Function.apply`` becomes torch.func's ``custom_function_call``, which must run above
the dispatcher, not inside an op's Autograd kernel ("could not find kernel for HigherOrderOperator
custom_function_call at dispatch key AutogradCPU"). A single-level Function records the op at the
current transform level only, as a C++ autograd kernel does, and its forward redispatches below
Autograd, which hands the op to the next level down. Both names are private to torch (present
since torch 2.0); torch.func's own generated Functions are built the same way.

``attention``'s Autograd kernel is C++ (csrc/ops/attention.cpp, AttentionFunction): its twelve
arguments made a Python kernel cost more than the op itself on small problems. Under ``torch.func``
transforms and forward AD, ``safeattn.attention`` (ops.py) calls the ATen composite
``_attention_math`` instead (csrc/ops/attention_composite.cpp). ``sdpa_mask`` has no gradient: its
Autograd kernel is PyTorch's not-implemented fallback, registered in C++ (csrc/ops/sdpa_mask.cpp).
"""

from __future__ import annotations

import torch
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd import forward_ad as _forward_ad
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch.autograd.function import _SingleLevelFunction

_ops = torch.ops.safeattn
# The Autograd kernels and vmap rules live as long as this module (a Library drops its
# registrations when it is collected).
_lib = torch.library.Library("safeattn", "IMPL")


def _redispatch_below_autograd(op, keyset, *args):
    """The op's kernel, for a Function's forward: the keys after Autograd, as a C++ autograd
    kernel redispatches. Under a torch.func transform that reaches the next transform level
    down, which may differentiate the op again: the Function turned gradient recording off for
    its forward, and that level needs it back on (as torch.func does for autograd.Function)."""
    if torch._C._are_functorch_transforms_active():
        with torch.enable_grad(), _set_fwd_grad_enabled(True), torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)


def _in_backward(op, *args):
    """Call a backward op from a backward formula. When nothing will differentiate the result
    (no create_graph, no dual level, no transform: every first-order backward) the call skips
    the op's Autograd kernel (Python, about 3.5 us on a small tensor) for the fused kernel."""
    if (
        torch.is_grad_enabled()
        or _forward_ad._current_level >= 0
        or torch._C._are_functorch_transforms_active()
    ):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _any_requires_grad(*args) -> bool:
    """torch._C._any_requires_grad of torch 2.7 and later, for torch 2.6."""
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _register_autograd_kernel(name: str, function: type[_SingleLevelFunction]) -> None:
    op = getattr(_ops, name).default
    # The dispatcher drops trailing arguments equal to their defaults; the Function gets them all.
    defaults = tuple(a.default_value if a.has_default_value() else None for a in op._schema.arguments)
    # Bound once: the inference path below runs on every call of the op.
    transforms_active = torch._C._are_functorch_transforms_active
    grad_enabled = torch._C.is_grad_enabled
    any_requires_grad = getattr(torch._C, "_any_requires_grad", _any_requires_grad)  # torch >= 2.7
    below_autograd = torch._C._AutoDispatchBelowAutograd
    after_autograd = torch._C._after_autograd_keyset
    redispatch = op.redispatch

    def kernel(keyset, *args):
        if transforms_active():
            with enable_single_level_autograd_function():
                return function.apply(keyset, *args, *defaults[len(args) :])
        # A gradient wanted, or a forward-AD dual level open (an input may carry a tangent).
        if (grad_enabled() and any_requires_grad(*args)) or _forward_ad._current_level >= 0:
            return function.apply(keyset, *args, *defaults[len(args) :])
        # The inference path: the fused kernel, after the three checks above.
        with below_autograd():
            return redispatch(keyset & after_autograd, *args)

    _lib.impl(name, kernel, "Autograd", with_keyset=True)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """float16 / bfloat16 in float32 (as the kernels accumulate); other dtypes unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


# ---- the derivative of the softmax backward with respect to the softmax output -------------
# The backward ops compute h = y * (g' - sum(g' * y)) with g' = g where y != 0 and 0 where y == 0
# (an element whose output is 0, such as a masked one, neither gets nor passes a gradient:
# a NaN upstream gradient there never leaks). With respect to g, h is J g (the op itself);
# with respect to y, these two give the tangent and the vector-Jacobian product. The same
# convention holds for the incoming tangent or cotangent: 0 where y == 0, so that a NaN there
# stays out too (in a composition y == 0 only where its own tangent is 0 anyway).


def _zero_where_out_zero(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.where(y == 0, torch.zeros((), dtype=t.dtype, device=t.device), t)


def _backward_terms(g, y, v, dim):
    """What both products below start from, in the accumulation dtype: y, g' and v' (0 where
    y == 0), and sum(g' y)."""
    y_acc = _acc(y)
    g_acc = _zero_where_out_zero(_acc(g).to(y_acc.dtype), y)
    v_acc = _zero_where_out_zero(_acc(v).to(y_acc.dtype), y)
    return y_acc, g_acc, v_acc, (g_acc * y_acc).sum(dim, keepdim=True)


def _backward_jvp_wrt_out(g, y, tangent_y, dim):
    """d h / d y applied to tangent_y: t' * (g' - sum(g' y)) - y * sum(g' t')."""
    y_acc, g_acc, t_acc, s = _backward_terms(g, y, tangent_y, dim)
    return t_acc * (g_acc - s) - y_acc * (g_acc * t_acc).sum(dim, keepdim=True)


def _backward_vjp_wrt_out(g, y, u, dim):
    """u^T d h / d y: u' * (g' - sum(g' y)) - g' * sum(u' y)."""
    y_acc, g_acc, u_acc, s = _backward_terms(g, y, u, dim)
    return u_acc * (g_acc - s) - g_acc * (u_acc * y_acc).sum(dim, keepdim=True)


# ---- safe_softmax ------------------------------------------------------------------------------


class _SafeSoftmax(_SingleLevelFunction):
    @staticmethod
    def forward(keyset, self, dim, dtype):
        return _redispatch_below_autograd(_ops.safe_softmax.default, keyset, self, dim, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keyset, self, dim, _dtype = inputs
        ctx.dim = dim
        ctx.input_dtype = self.dtype
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return (
            None,
            _in_backward(_ops._safe_softmax_backward.default, grad, out, ctx.dim, ctx.input_dtype),
            None,
            None,
        )

    @staticmethod
    def jvp(ctx, _keyset, tangent, *_):
        # J is symmetric: the tangent is the backward op applied to the (cast) input tangent.
        (out,) = ctx.saved_tensors
        return _ops._safe_softmax_backward(tangent, out, ctx.dim, out.dtype)


def _grad_op_vjp(ctx, grad_out, out, u):
    """The vector-Jacobian products of h = J(y) g (the backward ops, inputs 1 and 2: g, y) with
    u, as the two grad classes below need them (None where not asked for)."""
    grad_g = grad_y = None
    if ctx.needs_input_grad[1]:
        grad_g = _in_backward(_ops._safe_softmax_backward.default, u, out, ctx.dim, ctx.grad_out_dtype)
    if ctx.needs_input_grad[2]:
        grad_y = _backward_vjp_wrt_out(grad_out, out, u, ctx.dim).to(out.dtype)
    return grad_g, grad_y


def _grad_op_jvp(ctx, grad_out, out, tangent_g, tangent_y):
    """The tangent of h = J(y) g, in the accumulation dtype: J tangent_g plus d h / d y tangent_y."""
    h = None
    if tangent_g is not None:
        h = _acc(_ops._safe_softmax_backward(tangent_g, out, ctx.dim, out.dtype))
    if tangent_y is not None:
        part = _backward_jvp_wrt_out(grad_out, out, tangent_y, ctx.dim)
        h = part if h is None else h + part
    return h


class _SafeSoftmaxGrad(_SingleLevelFunction):
    """h = _safe_softmax_backward(g, y): linear in g (J g), and y-dependent (double backward)."""

    @staticmethod
    def forward(keyset, grad_out, out, dim, input_dtype):
        return _redispatch_below_autograd(
            _ops._safe_softmax_backward.default, keyset, grad_out, out, dim, input_dtype
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keyset, grad_out, out, dim, input_dtype = inputs
        ctx.dim = dim
        ctx.input_dtype = input_dtype
        ctx.grad_out_dtype = grad_out.dtype
        ctx.save_for_backward(grad_out, out)
        ctx.save_for_forward(grad_out, out)

    @staticmethod
    def backward(ctx, grad):
        grad_out, out = ctx.saved_tensors
        grad_g, grad_y = _grad_op_vjp(ctx, grad_out, out, grad)
        return None, grad_g, grad_y, None, None

    @staticmethod
    def jvp(ctx, _keyset, tangent_g, tangent_y, *_):
        grad_out, out = ctx.saved_tensors
        return _grad_op_jvp(ctx, grad_out, out, tangent_g, tangent_y).to(ctx.input_dtype)


# ---- masked_softmax -----------------------------------------------------------------------


class _MaskedSoftmax(_SingleLevelFunction):
    @staticmethod
    def forward(keyset, scores, mask, scale, dim, dtype):
        return _redispatch_below_autograd(
            _ops.masked_softmax.default, keyset, scores, mask, scale, dim, dtype
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keyset, scores, mask, scale, dim, _dtype = inputs
        ctx.scale = scale
        ctx.dim = dim
        ctx.input_dtype = scores.dtype
        # The mask is saved for its shape and dtype (the bias gradient is reduced to them); saving
        # an input copies nothing.
        ctx.save_for_backward(output, mask)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad):
        out, mask = ctx.saved_tensors
        mask_requires_grad = bool(mask is not None and ctx.needs_input_grad[2])
        grad_scores, grad_mask = _in_backward(
            _ops._masked_softmax_backward.default,
            grad,
            out,
            mask,
            ctx.scale,
            ctx.dim,
            ctx.input_dtype,
            mask_requires_grad,
        )
        return (
            None,
            grad_scores if ctx.needs_input_grad[1] else None,
            grad_mask if mask_requires_grad else None,
            None,
            None,
            None,
        )

    @staticmethod
    def jvp(ctx, _keyset, tangent_scores, tangent_mask, *_):
        # The tangent of x = scores * scale + mask, through the symmetric J.
        (out,) = ctx.saved_tensors
        tangent = None
        if tangent_scores is not None:
            tangent = tangent_scores.to(out.dtype) * ctx.scale
        if tangent_mask is not None:
            tangent_mask = tangent_mask.to(out.dtype)
            tangent = tangent_mask.expand(out.shape) if tangent is None else tangent + tangent_mask
        if tangent is None:
            return torch.zeros_like(out)
        return _ops._safe_softmax_backward(tangent, out, ctx.dim, out.dtype)


class _MaskedSoftmaxGrad(_SingleLevelFunction):
    """(scale * h, sum_to(h, mask)) with h = J g: linear in g, y-dependent; the mask is read
    for its shape only (no gradient)."""

    @staticmethod
    def forward(keyset, grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad):
        return _redispatch_below_autograd(
            _ops._masked_softmax_backward.default,
            keyset,
            grad_out,
            out,
            mask,
            scale,
            dim,
            input_dtype,
            mask_requires_grad,
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        _keyset, grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad = inputs
        ctx.scale = scale
        ctx.dim = dim
        ctx.input_dtype = input_dtype
        ctx.grad_out_dtype = grad_out.dtype
        ctx.mask_requires_grad = mask_requires_grad
        if not mask_requires_grad:
            ctx.mark_non_differentiable(output[1])  # the empty placeholder
        ctx.save_for_backward(grad_out, out, mask)
        ctx.save_for_forward(grad_out, out, mask)

    @staticmethod
    def backward(ctx, grad_scores, grad_mask):
        grad_out, out, _mask = ctx.saved_tensors
        # The incoming vector on h: scale * grad_scores, plus the mask gradient's cotangent
        # broadcast back over the dims sum_to reduced.
        u = _acc(grad_scores).to(_acc(out).dtype) * ctx.scale
        if ctx.mask_requires_grad and grad_mask is not None:
            u = u + _acc(grad_mask).to(u.dtype)
        grad_g, grad_y = _grad_op_vjp(ctx, grad_out, out, u)
        return None, grad_g, grad_y, None, None, None, None, None

    @staticmethod
    def jvp(ctx, _keyset, tangent_g, tangent_y, *_):
        grad_out, out, mask = ctx.saved_tensors
        h = _grad_op_jvp(ctx, grad_out, out, tangent_g, tangent_y)
        tangent_scores = (h * ctx.scale).to(ctx.input_dtype)
        tangent_mask = None
        if ctx.mask_requires_grad:
            tangent_mask = h.sum_to_size(mask.shape).to(mask.dtype)
        return tangent_scores, tangent_mask


_register_autograd_kernel("safe_softmax", _SafeSoftmax)
_register_autograd_kernel("_safe_softmax_backward", _SafeSoftmaxGrad)
_register_autograd_kernel("masked_softmax", _MaskedSoftmax)
_register_autograd_kernel("_masked_softmax_backward", _MaskedSoftmaxGrad)


# ---- vmap rules ----------------------------------------------------------------------------
# Each rule moves the vmapped dim to the front (an unbatched tensor next to a batched one is
# expanded, a view), calls the op once on the whole batch with dim shifted by one, and says the
# output is batched at 0. A 0-D slice (softmax over one element) is lifted to 1-D first.


def _wrap_dim(op: str, dim: int, rank: int) -> int:
    n = max(rank, 1)
    if not -n <= dim < n:
        # The op's own message (csrc/ops/softmax.cpp), with the rank the caller sees.
        raise RuntimeError(
            f"{op}: dim {dim} is out of range for a {rank}-D tensor (expected in [{-n}, {n - 1}])"
        )
    return dim % n


def _front(t: torch.Tensor, bdim: int | None, batch_size: int) -> torch.Tensor:
    return t.expand(batch_size, *t.shape) if bdim is None else t.movedim(bdim, 0)


def _batched_mask(mask: torch.Tensor, bdim: int | None, batch_size: int, rank: int) -> torch.Tensor:
    """A mask batched (or expanded) at 0, with size-1 dims after the batch dim so that it
    broadcasts against the batched scores [N, ...] of logical rank `rank` from the right."""
    m = _front(mask, bdim, batch_size)
    return m.reshape(batch_size, *([1] * (rank - (m.dim() - 1))), *m.shape[1:]) if m.dim() - 1 < rank else m


def _in_dims(in_dims, count):
    return tuple(in_dims) + (None,) * (count - len(in_dims))


@torch.library.register_vmap("safeattn::safe_softmax", lib=_lib)
def _safe_softmax_vmap(info, in_dims, self, dim, dtype=None):
    x = _front(self, in_dims[0], info.batch_size)
    rank = x.dim() - 1
    wrapped = _wrap_dim("safe_softmax", dim, rank)
    if rank == 0:
        return _ops.safe_softmax(x.unsqueeze(1), 1, dtype).squeeze(1), 0
    return _ops.safe_softmax(x, wrapped + 1, dtype), 0


@torch.library.register_vmap("safeattn::_safe_softmax_backward", lib=_lib)
def _safe_softmax_backward_vmap(info, in_dims, grad_out, out, dim, input_dtype):
    n = info.batch_size
    g_dim, y_dim = _in_dims(in_dims, 2)[:2]
    g, y = _front(grad_out, g_dim, n), _front(out, y_dim, n)
    rank = y.dim() - 1
    wrapped = _wrap_dim("_safe_softmax_backward", dim, rank)
    if rank == 0:
        return _ops._safe_softmax_backward(g.unsqueeze(1), y.unsqueeze(1), 1, input_dtype).squeeze(1), 0
    return _ops._safe_softmax_backward(g, y, wrapped + 1, input_dtype), 0


@torch.library.register_vmap("safeattn::masked_softmax", lib=_lib)
def _masked_softmax_vmap(info, in_dims, scores, mask=None, scale=1.0, dim=-1, dtype=None):
    n = info.batch_size
    s_dim, m_dim = _in_dims(in_dims, 2)[:2]
    rank = scores.dim() - (s_dim is not None)
    wrapped = _wrap_dim("masked_softmax", dim, rank)
    x = _front(scores, s_dim, n)
    if mask is not None and m_dim is not None:
        mask = _batched_mask(mask, m_dim, n, rank)
    if rank == 0:
        x = x.unsqueeze(1)
        mask = mask.unsqueeze(1) if mask is not None and m_dim is not None else mask
        return _ops.masked_softmax(x, mask, scale, 1, dtype).squeeze(1), 0
    return _ops.masked_softmax(x, mask, scale, wrapped + 1, dtype), 0


@torch.library.register_vmap("safeattn::_masked_softmax_backward", lib=_lib)
def _masked_softmax_backward_vmap(
    info, in_dims, grad_out, out, mask, scale, dim, input_dtype, mask_requires_grad
):
    n = info.batch_size
    g_dim, y_dim, m_dim = _in_dims(in_dims, 3)[:3]
    g, y = _front(grad_out, g_dim, n), _front(out, y_dim, n)
    rank = y.dim() - 1
    wrapped = _wrap_dim("_masked_softmax_backward", dim, rank)
    mask_shape = None
    if mask is not None and (m_dim is not None or mask_requires_grad):
        # A mask that gets a gradient needs a batch dim even when it is shared: each vmapped
        # call has its own mask gradient, so the op must not sum over the batch.
        mask_shape = mask.shape if m_dim is None else mask.movedim(m_dim, 0).shape[1:]
        mask = _batched_mask(mask, m_dim, n, max(rank, 1))
    if rank == 0:
        g, y = g.unsqueeze(1), y.unsqueeze(1)
        wrapped = 0
    grad_scores, grad_mask = _ops._masked_softmax_backward(
        g, y, mask, scale, wrapped + 1, input_dtype, mask_requires_grad
    )
    if rank == 0:
        grad_scores = grad_scores.squeeze(1)
    if mask_requires_grad:
        return (grad_scores, grad_mask.reshape(n, *mask_shape)), (0, 0)
    return (grad_scores, grad_mask), (0, None)
