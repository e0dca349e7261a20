"""Transformers' mask functions read as mask descriptions: closure in, description or reason out.

Transformers describes a mask as a Python predicate ``mask_function(b, h, q_idx, kv_idx)``
composed from a few factories of ``transformers.masking_utils``: ``causal_mask_function``,
``bidirectional_mask_function`` (5.x), ``sliding_window_overlay(w)``,
``sliding_window_bidirectional_overlay(w)`` (5.x), ``chunked_overlay(c, left_padding)``,
``padding_mask_function(pm)``, ``packed_sequence_mask_function(ids)``,
``blockwise_overlay(ids)`` (5.x), joined by ``and_masks`` / ``or_masks``; from 5.23 the rules of
a packed batch are wrapped by ``remap_positions_for_packed_sequence`` (read on position ids, which
count from each sequence's start). What is not passed to
the mask interface as data (the window, the chunk size, the padding and sequence-id tensors)
lives in the closures.

:func:`read_mask_function` recognises a closure by its code object (the inner function of a
factory has one code object for every closure it makes), reads its parameters from its cells by
free-variable name, and gives a :class:`MaskDescription` (the public
``safeattn.MaskDescription``), or :class:`NotRecognised` with the reason in words. A factory
missing from this Transformers release, or whose free variables are named otherwise, is not
recognised; tests/test_transformers_masks.py fails when a mask that a supported model builds is
not recognised, so a release that renames what is read here shows up as a test failure, not as a
silent fallback.

The description is the mask in the terms of the native op, ``((base AND packed) OR block) AND
padding`` (``safeattn.sdpa_mask``'s docstring gives each rule): a causal flag, a window, a
chunking, and ``[B]`` / ``[B, L]`` tensors (chunk left padding, key padding, packed and block
ids), never a ``[B, 1, Q, KV]`` tensor. ``MaskDescription.materialise`` builds it densely through
``safeattn.sdpa_mask``, so every description has a dense twin to test against, and
``safeattn.attention`` takes the description itself.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import masking_utils as _mu

from .ops import MaskDescription, _and_padding

__all__ = ["MaskDescription", "NotRecognised", "read_mask_function", "recognised_factories"]

# Dynamo in torch 2.11 cannot read the cells of a closure created inside the compiled region
# (Transformers builds its mask closures in the model's forward): iterating `__closure__` is an
# unsupported graph break there (seen on the GPU host: torch 2.11, Python 3.12), while torch 2.14
# traces it. Before 2.14, under compile, such closures are left to Transformers' own mask code.
DYNAMO_READS_CLOSURES = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


@dataclasses.dataclass(frozen=True)
class NotRecognised:
    """A mask function the reader cannot describe; ``reason`` says why in words (the same words
    for the same cause, so that a caller can report each reason once)."""

    reason: str


# --------------------------------------------------------------------------------------------
# The factories' code objects, probed once from this Transformers release
# --------------------------------------------------------------------------------------------
_UNDER_COMPILE = "mask closures cannot be read under torch.compile before torch 2.14"


def _cells(fn) -> dict | NotRecognised:
    """{free variable name: value} of a closure, or why it cannot be read."""
    if not DYNAMO_READS_CLOSURES and torch.compiler.is_compiling():
        return NotRecognised(_UNDER_COMPILE)
    closure = getattr(fn, "__closure__", None)
    code = getattr(fn, "__code__", None)
    if closure is None or code is None:
        return NotRecognised(f"{_name(fn)} has no closure to read")
    try:
        return dict(zip(code.co_freevars, (cell.cell_contents for cell in closure), strict=True))
    except ValueError:  # an empty cell
        return NotRecognised(f"{_name(fn)} has an empty closure cell")


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _probe_code(factory_name: str, *args):
    """The code object of the closures a masking_utils factory returns (None if absent)."""
    factory = getattr(_mu, factory_name, None)
    if factory is None:
        return None
    try:
        fn = factory(*args)
    except Exception:  # a factory whose arguments changed: leave it unrecognised
        return None
    return getattr(fn, "__code__", None)


_DUMMY_LEFT_PADDING = torch.zeros(1, dtype=torch.long)
_DUMMY_IDS = torch.zeros(1, 1, dtype=torch.long)

# [(code object, leaf kind, factory name)]: a list compared by identity (code objects are not
# hashed, so torch.compile traces the lookup as plain constants).
_LEAF_CODES: list = []
# [(code object, reason)]: leaves found but dropped by _self_check_leaves.
_CHANGED_CODES: list = []


def _add_leaf(factory_name: str, kind: str, freevars: tuple[str, ...], *args) -> None:
    code = _probe_code(factory_name, *args)
    if code is not None and all(name in code.co_freevars for name in freevars):
        _LEAF_CODES.append((code, kind, factory_name))


_AND_CODE = _probe_code("and_masks", _mu.causal_mask_function)
_OR_CODE = _probe_code("or_masks", _mu.causal_mask_function)
_REMAP_CODE = _probe_code("remap_positions_for_packed_sequence", _mu.causal_mask_function, _DUMMY_IDS)
_add_leaf("sliding_window_overlay", "sliding", ("sliding_window",), 1)
_add_leaf("sliding_window_bidirectional_overlay", "sliding_bidirectional", ("sliding_window",), 1)
_add_leaf("chunked_overlay", "chunked", ("chunk_size", "left_padding"), 1, _DUMMY_LEFT_PADDING)
_add_leaf("_legacy_chunked_overlay", "chunked", ("chunk_size",), 1)
_add_leaf("padding_mask_function", "padding", ("padding_mask",), _DUMMY_IDS)
_add_leaf("packed_sequence_mask_function", "packed", ("packed_sequence_mask",), _DUMMY_IDS)
_add_leaf("blockwise_overlay", "block", ("block_sequence_ids",), _DUMMY_IDS)

_CAUSAL_FN = _mu.causal_mask_function
_CAUSAL_CHANGED = "Transformers' causal_mask_function no longer means kv <= q"
_BIDIRECTIONAL_FN = getattr(_mu, "bidirectional_mask_function", None)


def _self_check_leaves() -> bool:
    """Drops a leaf whose Transformers predicate does not mean what the description says.

    The factories are evaluated on a small grid of positions and compared with the formulas of
    the native op; a Transformers release that changed a predicate then falls back (saying so)
    instead of giving a different mask. Returns False when causal_mask_function itself changed:
    then nothing is recognised.
    """
    q = torch.arange(-3, 12).view(1, 1, -1, 1)
    kv = torch.arange(-3, 12).view(1, 1, 1, -1)
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    left = torch.tensor([2])
    expected = {
        "sliding_window_overlay": lambda: (_mu.sliding_window_overlay(3), kv > q - 3),
        "sliding_window_bidirectional_overlay": lambda: (
            _mu.sliding_window_bidirectional_overlay(3),
            (q - kv).abs() <= 3,
        ),
        "chunked_overlay": lambda: (
            _mu.chunked_overlay(3, left),
            torch.div(kv - 2, 3, rounding_mode="floor") == torch.div(q - 2, 3, rounding_mode="floor"),
        ),
    }
    for entry in list(_LEAF_CODES):
        code, _, factory_name = entry
        if factory_name not in expected:
            continue
        try:
            fn, want = expected[factory_name]()
            got = fn(b, h, q, kv)
            ok = fn.__code__ is code and torch.equal(torch.as_tensor(got).expand_as(want), want)
        except Exception:
            ok = False
        if not ok:
            _LEAF_CODES.remove(entry)
            _CHANGED_CODES.append(
                (code, f"Transformers' {factory_name} no longer means what safeattn reads it as")
            )
    if torch.equal(_CAUSAL_FN(b, h, q, kv), kv <= q):
        return True
    _CHANGED_CODES.extend((code, _CAUSAL_CHANGED) for code, _, _ in _LEAF_CODES)
    _LEAF_CODES.clear()
    return False


_CAUSAL_OK = _self_check_leaves()


def recognised_factories() -> set[str]:
    """Names of the masking_utils factories this Transformers release has and the reader reads."""
    names = {factory_name for _, _, factory_name in _LEAF_CODES}
    if _CAUSAL_OK:
        names.add("causal_mask_function")
        if _BIDIRECTIONAL_FN is not None:
            names.add("bidirectional_mask_function")
        if _AND_CODE is not None:
            names.add("and_masks")
        if _OR_CODE is not None:
            names.add("or_masks")
        if _REMAP_CODE is not None:
            names.add("remap_positions_for_packed_sequence")
    return names


def _leaf_kind(code) -> str | NotRecognised | None:
    for leaf_code, kind, _ in _LEAF_CODES:
        if leaf_code is code:
            return kind
    for changed_code, reason in _CHANGED_CODES:
        if changed_code is code:
            return NotRecognised(reason)
    return None


# --------------------------------------------------------------------------------------------
# Reading a composition
# --------------------------------------------------------------------------------------------
class _Form:
    """A composition being read, in the native op's shape: ``((base AND packed) OR block) AND
    padding``.

    base: ``causal`` (or everything), intersected with at most one sliding window and at most
    one chunking. ``None`` fields are absent.
    """

    __slots__ = ("causal", "sliding", "chunk", "packed", "block", "block_ored", "padding", "remapped")

    def __init__(self):
        self.causal = False
        self.sliding = None  # (kind, window): kind "causal" (kv > q - w) or "bidirectional" (|q - kv| <= w)
        self.chunk = None  # (chunk_size, left_padding [B] tensor or None)
        self.packed = None  # [B, L] sequence ids
        self.block = None  # [B, L] block ids
        # The block rule is native only ORed onto a base (blockwise_overlay alone, or ANDed,
        # is a different mask): False for the bare overlay, True once an OR has absorbed it.
        self.block_ored = False
        self.padding = None  # list of [B, L] padding masks, ANDed
        # The causal and window rules read position ids (remap_positions_for_packed_sequence):
        # the same rules on indices inside each packed sequence, whose positions step by 1.
        self.remapped = False

    def has_inner(self) -> bool:
        """True when the form constrains more than padding (so nothing may be ORed past it)."""
        return self.causal or self.sliding is not None or self.chunk is not None or self.packed is not None


_BLOCK_ANDED = "a blockwise_overlay ANDed with more than padding"


def _leaf_form(fn) -> _Form | NotRecognised:
    form = _Form()
    if fn is _CAUSAL_FN or (fn is not None and fn is _BIDIRECTIONAL_FN):
        if not _CAUSAL_OK:
            return NotRecognised(_CAUSAL_CHANGED)
        form.causal = fn is _CAUSAL_FN  # bidirectional: every query attends every key
        return form
    kind = _leaf_kind(getattr(fn, "__code__", None))
    if kind is None:
        return NotRecognised(f"{_name(fn)} is not one of Transformers' mask functions")
    if isinstance(kind, NotRecognised):
        return kind
    cells = _cells(fn)
    if isinstance(cells, NotRecognised):
        return cells
    if kind == "sliding":
        form.sliding = ("causal", cells["sliding_window"])
    elif kind == "sliding_bidirectional":
        form.sliding = ("bidirectional", cells["sliding_window"])
    elif kind == "chunked":
        form.chunk = (cells["chunk_size"], cells.get("left_padding"))
    elif kind == "padding":
        form.padding = [cells["padding_mask"]]
    elif kind == "packed":
        form.packed = cells["packed_sequence_mask"]
    elif kind == "block":
        form.block = cells["block_sequence_ids"]
    # A window or chunk size that is not a plain int (a tensor, say) is not ours to read.
    if form.sliding is not None and not isinstance(form.sliding[1], int):
        return NotRecognised("a sliding window that is not a Python int")
    if form.chunk is not None and not isinstance(form.chunk[0], int):
        return NotRecognised("a chunk size that is not a Python int")
    return form


def _and_forms(forms: list[_Form]) -> _Form | NotRecognised:
    out = _Form()
    for form in forms:
        if form.block is not None:
            # (X OR block) AND Y is representable only when Y is padding: padding is the
            # outermost AND of the native rule.
            if out.block is not None or not form.block_ored:
                return NotRecognised(_BLOCK_ANDED)
            out.block, out.block_ored = form.block, True
        if form.padding is not None:
            out.padding = (out.padding or []) + form.padding
        out.causal = out.causal or form.causal
        out.remapped = out.remapped or form.remapped
        for field in ("sliding", "chunk", "packed"):
            theirs = getattr(form, field)
            if theirs is None:
                continue
            ours = getattr(out, field)
            # Windows compare by value; chunkings and ids hold tensors, which must be the same
            # object (comparing their values would read them). Otherwise: not one native mask.
            same = ours == theirs if field == "sliding" else ours is theirs
            if ours is not None and not same:
                return NotRecognised(f"and_masks of two different {field} rules")
            setattr(out, field, theirs)
    if out.block is not None:
        # Everything other than padding must have come from the same OR branch as the block.
        inner = [f for f in forms if f.has_inner()]
        if len(inner) > 1 or (inner and inner[0].block is None):
            return NotRecognised(_BLOCK_ANDED)
    return out


def _or_forms(forms: list[_Form]) -> _Form | NotRecognised:
    if len(forms) == 1:
        return forms[0]
    if len(forms) == 2:
        first, second = forms
        for base, block in ((first, second), (second, first)):
            block_only = (
                block.block is not None
                and not block.block_ored
                and not block.has_inner()
                and block.padding is None
            )
            if block_only and base.block is None and base.padding is None:
                out = _Form()
                for field in ("causal", "sliding", "chunk", "packed", "remapped"):
                    setattr(out, field, getattr(base, field))
                out.block, out.block_ored = block.block, True
                return out
    return NotRecognised("or_masks of anything but a mask and one blockwise_overlay")


_REMAPPED_ONLY = "positions remapped for packing around more than causal and window rules"


def _read_remapped(fn, depth: int) -> _Form | NotRecognised:
    """remap_positions_for_packed_sequence(mask_function, position_ids): mask_function on each
    packed sequence's own positions. Causal and window rules depend on q - kv alone, which the
    positions keep inside a sequence (Transformers splits the packing where they do not step by
    1), so they read as on indices once ANDed with the packed ids (_describe checks that). A
    chunking counts from position 0 and padding is indexed by position: not read."""
    cells = _cells(fn)
    if isinstance(cells, NotRecognised):
        return cells
    form = _read(cells.get("mask_function"), depth + 1)
    if isinstance(form, NotRecognised):
        return form
    if (
        form.chunk is not None
        or form.padding is not None
        or form.packed is not None
        or form.block is not None
    ):
        return NotRecognised(_REMAPPED_ONLY)
    form.remapped = True
    return form


def _read(fn, depth: int) -> _Form | NotRecognised:
    if depth > 32:
        return NotRecognised("mask functions nested more than 32 deep")
    if not callable(fn):
        return NotRecognised(f"a mask function that is not callable ({type(fn).__name__})")
    code = getattr(fn, "__code__", None)
    if code is not None and code is _REMAP_CODE:
        return _read_remapped(fn, depth)
    if code is not None and (code is _AND_CODE or code is _OR_CODE):
        cells = _cells(fn)
        if isinstance(cells, NotRecognised):
            return cells
        children = cells.get("mask_functions")
        if not isinstance(children, tuple) or not children:
            return NotRecognised("and_masks / or_masks whose closure holds no mask_functions tuple")
        forms = []
        for child in children:
            form = _read(child, depth + 1)
            if isinstance(form, NotRecognised):
                return form
            forms.append(form)
        return _and_forms(forms) if code is _AND_CODE else _or_forms(forms)
    return _leaf_form(fn)


def _describe(form: _Form) -> MaskDescription | NotRecognised:
    """The description of a read composition, or why the native op cannot build it."""
    if form.block is not None and not form.block_ored:
        return NotRecognised("a blockwise_overlay not ORed onto a mask")
    if form.remapped and form.packed is None:
        return NotRecognised("positions remapped for packed sequences without their packed mask")
    sliding_window = None
    if form.sliding is not None:
        kind, window = form.sliding
        if kind == "causal":
            if not form.causal:
                return NotRecognised("a causal sliding_window_overlay without the causal mask")
            sliding_window = window
        elif form.causal:
            # kv <= q and |q - kv| <= w is the causal window of w + 1 keys.
            sliding_window = window + 1
        else:
            sliding_window = window
        if sliding_window <= 0:
            return NotRecognised("a sliding window that is not positive")
    chunk_size = chunk_left_padding = None
    if form.chunk is not None:
        chunk_size, chunk_left_padding = form.chunk
        if chunk_size <= 0:
            return NotRecognised("a chunk size that is not positive")
    padding_mask = None
    for padding in form.padding or []:
        padding_mask = _and_padding(padding_mask, padding)
    return MaskDescription(
        causal=form.causal,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        chunk_left_padding=chunk_left_padding,
        padding_mask=padding_mask,
        packed_ids=form.packed,
        block_ids=form.block,
        # Transformers' packed ids are a cumulative sum over position_ids resets: one run each.
        packed_ids_are_runs=form.packed is not None,
    )


def read_mask_function(mask_function) -> MaskDescription | NotRecognised:
    """The description of a Transformers mask function, or :class:`NotRecognised` with the reason.

    Args:
        mask_function: what Transformers passes to a mask interface as ``mask_function``: a
            ``masking_utils`` factory's closure, ``causal_mask_function``, or an
            ``and_masks`` / ``or_masks`` of those at any nesting.

    Reads no tensor values (no host synchronisation); traceable by ``torch.compile`` from
    torch 2.14 (before it, under compile, every closure is :class:`NotRecognised`).
    """
    form = _read(mask_function, 0)
    if isinstance(form, NotRecognised):
        return form
    return _describe(form)
