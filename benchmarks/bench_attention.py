"""`speechlm bench attention`: one decoder layer, forward + backward, per attention backend (CUDA).

Letters: T packed tokens, B rows, S padded row length, H hidden.

For each total of 8k, 32k and 64k tokens, ~200 utterances with log-normal lengths are drawn once
(seeded) and fed to a one-layer Llama decoder (hidden 2048, 16 query heads, 4 K/V heads, head dim
128, bf16 autocast) through each backend:
- THD backends (reference, torch_varlen, flex, flash, te where installed): one packed row with
  cu_seqlens, no padding;
- sdpa-BSHD: the same utterances padded to the longest into B rows with a padding mask (the layout
  the packed ones replace).
It reports the median time of forward + backward over `--repeats` runs after warm-up, and the peak
CUDA memory of one run, each also as a ratio against sdpa-BSHD. `--json FILE` writes the records.
On a machine without CUDA it says so and exits 2 (the kernel-call counts that run on CPU are
`speechlm bench cp` and the tests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch


def draw_lengths(total: int, n: int, seed: int = 0) -> list[int]:
    """n log-normal lengths (sigma 0.6) scaled to add up to exactly `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(n, generator=g) * 0.6)
    lens = (raw / raw.sum() * total).floor().clamp(min=1).long()
    lens[0] += total - int(lens.sum())
    return lens.tolist()


def build_layer(backend: str, hidden: int, heads: int, kv_heads: int) -> Any:
    from speechlm.config import LLMConfig
    from speechlm.model.attention import ensure_registered
    from speechlm.model.llm import build_llm

    cfg = LLMConfig(hidden_size=hidden, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                    intermediate_size=4 * hidden, max_position_embeddings=1 << 17)  # fmt: skip
    llm = build_llm(cfg, vocab_size=128, pad_id=0, bos_id=1, eos_id=2, dropout=0.0,
                    attn_implementation=ensure_registered(backend))  # fmt: skip
    return llm.model.cuda()  # the decoder stack without the LM head


def make_inputs(lens: list[int], hidden: int, packed: bool) -> dict[str, Any]:
    dev = "cuda"
    if packed:
        t = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
        mx = max(lens)
        return dict(inputs_embeds=torch.randn(1, t, hidden, device=dev), position_ids=pos[None], cu_seq_lens_q=cu,
                    cu_seq_lens_k=cu, max_length_q=mx, max_length_k=mx)  # fmt: skip
    b, s = len(lens), max(lens)
    mask = (torch.arange(s)[None] < torch.tensor(lens)[:, None]).to(dev)
    pos = torch.arange(s, device=dev)[None].expand(b, s)
    return dict(inputs_embeds=torch.randn(b, s, hidden, device=dev), attention_mask=mask, position_ids=pos)


def time_backend(
    backend: str, lens: list[int], *, hidden: int, heads: int, kv_heads: int, repeats: int
) -> dict:
    packed = backend != "sdpa-bshd"
    name = "sdpa" if backend == "sdpa-bshd" else backend
    torch.manual_seed(0)
    layer = build_layer(name, hidden, heads, kv_heads)
    inputs = make_inputs(lens, hidden, packed)
    inputs["inputs_embeds"].requires_grad_()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(**inputs).last_hidden_state
        out.float().square().mean().backward()

    for _ in range(2):  # warm-up (and compilation for flex)
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base
    computed = len(lens) * max(lens) if not packed else sum(lens)
    return {"backend": backend, "ms": 1000 * statistics.median(times), "peak_mib": peak / 2**20,
            "computed_tokens": computed, "real_tokens": sum(lens)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speechlm bench attention", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="8192,32768,65536", help="packed totals to measure")
    p.add_argument("--utterances", type=int, default=200)
    p.add_argument("--backends", default="sdpa-bshd,reference,torch_varlen,flex,flash,te")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("speechlm bench attention: needs a CUDA GPU (none found); nothing measured", file=sys.stderr)
        return 2
    from speechlm.model.attention import BackendUnavailableError, check_installed

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    records: list[dict] = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for total in (int(x) for x in args.tokens.split(",")):
        lens = draw_lengths(total, args.utterances)
        rows: dict[str, dict] = {}
        for backend in backends:
            try:
                if backend != "sdpa-bshd":
                    check_installed(backend)
                r = time_backend(backend, lens, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                                 repeats=args.repeats)  # fmt: skip
            except (BackendUnavailableError, ImportError) as e:
                print(f"  {total} tokens, {backend}: skipped ({str(e).splitlines()[0]})")
                continue
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"  {total} tokens, {backend}: out of memory")
                continue
            rows[backend] = r
            torch.cuda.empty_cache()  # the layer and inputs of that backend are gone with its frame
        ref = rows.get("sdpa-bshd")
        print(f"\n{total} tokens in {len(lens)} utterances (longest {max(lens)}):")
        print(f"  {'backend':<14}{'ms':>9}{'x bshd':>9}{'peak MiB':>11}{'x bshd':>9}{'computed/real':>15}")
        for backend, r in rows.items():
            r.update(tokens=total, utterances=len(lens))
            if ref is not None:
                r["time_vs_bshd"] = r["ms"] / ref["ms"]
                r["mem_vs_bshd"] = r["peak_mib"] / ref["peak_mib"]
            tr = f"{r.get('time_vs_bshd', float('nan')):.2f}"
            mr = f"{r.get('mem_vs_bshd', float('nan')):.2f}"
            print(f"  {backend:<14}{r['ms']:>9.2f}{tr:>9}{r['peak_mib']:>11.0f}{mr:>9}"
                  f"{r['computed_tokens'] / r['real_tokens']:>15.2f}")  # fmt: skip
            records.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
