"""A whole Llama-shaped model: training steps and prefill with sdpa, flex_attention and safeattn.

The attention implementations of Transformers compared where users feel them: one training step
(forward with labels, backward; no optimizer, whose step is the same for all) and one prefill
forward (no cache, last logits only), each with and without left padding, eager and with the
model under ``torch.compile``: the four configurations of the performance target (padded or
not, eager or compiled) for both phases. Every implementation runs on the same random weights
and tokens, in the same process, in turns. Median of the repeats (CUDA events on the GPU).

    python -m safeattn bench model --device cuda [--markdown]     # the targets' shape (H100: minutes)
    python -m safeattn bench model --tiny --no-compile             # a small model, seconds on a CPU
    python -m safeattn bench model --device cuda --no-eager         # the compiled cases alone

Default shape (the model row of the performance targets): 8 layers, hidden 2048, 16 query heads
over 4 key/value heads of dim 128, MLP 5632, vocabulary 32000, bf16, batch 4 x 4096 tokens;
"padded": the first half of the rows carry S/4 left-padding tokens. ``vs best`` divides each
time by the fastest of the row's group (< 1.00x: slower than the best).
"""

from __future__ import annotations

import argparse
import copy

import torch

from ._bench import markdown_table, time_ms

IMPLEMENTATIONS = ("sdpa", "flex_attention", "safeattn")


def model_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(4096, args.seq),
        pad_token_id=0,
    )


def make_model(config, impl: str, device, dtype):
    """The model with attn_implementation=impl; the same random weights for every impl.

    Each model gets its own copy of the config: Transformers 5 writes the implementation into
    the config it is given, and its layers dispatch on that shared object, so models built from
    one config would all run the implementation named last."""
    import transformers

    import safeattn.transformers  # noqa: F401  registers attn_implementation="safeattn"

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
    return model.to(device=device, dtype=dtype)


def tokens(args, padded: bool, device):
    """input_ids, attention_mask [B, S]: the first half of the rows left-padded by S/4 (padded),
    or every row full."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)
    attention_mask = torch.ones(args.batch, args.seq, dtype=torch.long)
    if padded:
        pads = args.seq // 4
        attention_mask[: args.batch // 2, :pads] = 0
        input_ids[: args.batch // 2, :pads] = 0
    return input_ids.to(device), attention_mask.to(device)


def cases(args, device, dtype):
    """{(phase, padded, compiled): {impl: callable}} for the implementations that build."""
    config = model_config(args)
    models, failed = {}, {}
    for impl in args.impl:
        try:
            models[impl] = make_model(config, impl, device, dtype)
        except Exception as err:  # noqa: BLE001 - e.g. no flex_attention in this torch/transformers
            failed[impl] = f"{type(err).__name__}: {err}".splitlines()[0]
    compiled = {}
    if args.compile:
        compiled = {impl: torch.compile(model) for impl, model in models.items()}

    def train_step(model, input_ids, attention_mask):
        def step():
            model.train()  # both phases share the model: each sets its mode when it runs
            model.zero_grad(set_to_none=True)
            labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
            model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()

        return step

    def prefill(model, input_ids, attention_mask):
        def forward():
            model.eval()
            with torch.no_grad():
                model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)

        return forward

    table = {}
    for is_compiled, built in ((False, models if args.eager else {}), (True, compiled)):
        for padded in (True, False):
            input_ids, attention_mask = tokens(args, padded, device)
            mask = attention_mask if padded else None  # unpadded: no mask at all, as a user would call
            for phase, make in (("train step", train_step), ("prefill", prefill)):
                if built:
                    table[(phase, padded, is_compiled)] = {
                        impl: make(model, input_ids, mask) for impl, model in built.items()
                    }
    return table, failed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--impl", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager cases only")
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="compiled cases only")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="2 layers, hidden 128, 4/2 heads of 32, batch 2 x 128 (a CPU check)",
    )
    parser.add_argument("--quick", action="store_true", help="3 repeats after 1 warm-up")
    parser.add_argument("--markdown", action="store_true", help="also print the README's table")


def run(args: argparse.Namespace) -> int:
    import transformers

    if args.tiny:
        args.layers, args.hidden, args.mlp, args.heads, args.kv_heads, args.head_dim = 2, 128, 256, 4, 2, 32
        args.vocab, args.batch, args.seq = 512, 2, 128
    if args.quick:
        args.repeats, args.warmup = 3, 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench model: --device cuda but no CUDA device is visible")
        return 2
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    where = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"# transformers {transformers.__version__}, torch {torch.__version__}, {where}, {str(dtype)[6:]}; "
        f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads of {args.head_dim}, "
        f"batch {args.batch} x {args.seq}; median of {args.repeats}"
    )
    table, failed = cases(args, device, dtype)
    for impl, why in failed.items():
        print(f"# {impl}: n/a ({why})")
    rows = []
    for (phase, padded, compiled), impls in table.items():
        times = {}
        for impl, fn in impls.items():
            try:
                times[impl] = time_ms(fn, device, repeats=args.repeats, warmup=args.warmup)
            except Exception as err:  # noqa: BLE001 - a peer that cannot run this case
                print(f"# {phase}, {impl}: n/a ({type(err).__name__}: {str(err).splitlines()[0][:200]})")
        best = min(times.values(), default=None)
        for impl, ms in times.items():
            row = [
                phase,
                "padded" if padded else "unpadded",
                "compiled" if compiled else "eager",
                impl,
                f"{ms:.1f}",
                f"{best / ms:.2f}x",
            ]
            rows.append(row)
            print(" | ".join(row), flush=True)
    if args.markdown:
        print(f"\nREADME table (model, {args.device}):\n")
        print(markdown_table(["phase", "tokens", "mode", "attn_implementation", "ms", "vs best"], rows))
    return 0
