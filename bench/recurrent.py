"""The recurrent layers' kernels (Gated DeltaNet) against their bounds.

    python bench/recurrent.py [--device cpu] [--threads 2] [--heads 16,32]
                              [--dims 128x128] [--batch 1,4,8] [--prompt 512,2048]

Decode: one token for each of B sequences, each state ``[Hv, Dk, Dv]``
float32 in its slot of a store (Qwen3-Next 80B: Hk 16, Hv 32, Dk = Dv = 128,
2 MiB a layer a sequence). The step must read and write every state once, so
its bound is the state's bytes read and written over the copy bandwidth.
Each call takes the next B slots of a store of at least 512 MiB, so the
states come from memory, as in a model whose 36 recurrent layers' states
cannot stay in cache between steps. Printed: ms, GB/s of state read +
written, the fraction of copy bandwidth, for the torch reference and the
backend's kernel (compiled CPU or Triton).

Prefill: one sequence of T tokens from a zero state: the chunked form
(chunks of 64, the within-chunk part as matrix products; torch), the
backend's prefill (on the CPU kernels a scan: each head's state kept in
cache for every token) and the step-by-step form (one decode call per
token): tokens per second of each.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import copy_bandwidth, device_name, time_call  # noqa: E402

from strata_kernels.recurrent import (RecurrentStore, delta_rule_chunked, delta_rule_prefill,  # noqa: E402
                                      delta_rule_step)


def inputs(t: int, hk: int, hv: int, dk: int, dv: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1)
    v = torch.randn(t, hv, dv, generator=g)
    decay, beta = -torch.rand(t, hv, generator=g) * 0.1, torch.rand(t, hv, generator=g)
    return [x.to(device) for x in (q, k, v, decay, beta)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--heads", default="16,32", help="key heads, value heads")
    ap.add_argument("--dims", default="128x128", help="Dk x Dv")
    ap.add_argument("--batch", default="1,4,8", help="sequences per decode step")
    ap.add_argument("--prompt", default="512,2048", help="prefill lengths")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kernel = "cpu" if device.type == "cpu" else "triton"
    hk, hv = (int(x) for x in args.heads.split(","))
    dk, dv = (int(x) for x in args.dims.split("x"))
    bound = copy_bandwidth(device)
    state_bytes = hv * dk * dv * 4
    print(f"# {device_name(device)}, torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} "
          f"threads; Hk {hk}, Hv {hv}, Dk {dk}, Dv {dv}: {state_bytes / 2**20:.1f} MiB of state a sequence; "
          f"copy bandwidth {bound / 1e9:.1f} GB/s (read + write)")
    batches = [int(x) for x in args.batch.split(",")]
    n_slots = max(max(batches), -(-(512 << 20) // state_bytes))
    store = RecurrentStore.allocate(n_slots, 0, 1, hv, dk, dv, device)
    store.state.normal_(std=0.01)
    print(f"\n## decode: one token per sequence, the next B of {n_slots} slots each call")
    print("| B | backend | ms | GB/s (state read + written) | of copy bw |")
    print("|---|---|---|---|---|")
    for b in batches:
        rounds = [torch.arange(i * b, (i + 1) * b, device=device) % n_slots for i in range(n_slots // b)]
        q, k, v, decay, beta = inputs(b, hk, hv, dk, dv, device)
        for backend in ("torch", kernel):
            turn = iter(range(1 << 30))
            seconds = time_call(lambda: delta_rule_step(q, k, v, decay, beta, store.state,
                                                        rounds[next(turn) % len(rounds)], backend), device, args.reps)
            rate = 2 * b * state_bytes / seconds
            print(f"| {b} | {backend} | {seconds * 1e3:.3f} | {rate / 1e9:.1f} | {rate / bound:.0%} |")
    print("\n## prefill: one sequence from a zero state")
    print(f"| T | chunked (torch) tokens/s | {kernel} prefill tokens/s | step by step ({kernel}) tokens/s |")
    print("|---|---|---|---|")
    for t in (int(x) for x in args.prompt.split(",")):
        q, k, v, decay, beta = inputs(t, hk, hv, dk, dv, device)
        state = torch.zeros(1, hv, dk, dv, device=device)
        slot = torch.zeros(1, dtype=torch.long, device=device)

        def stepped():
            for i in range(t):
                delta_rule_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1], state, slot,
                                kernel)

        chunked_s = time_call(lambda: delta_rule_chunked(q, k, v, decay, beta, state[0]), device, args.reps)
        prefill_s = time_call(lambda: delta_rule_prefill(q, k, v, decay, beta, state[0], kernel), device, args.reps)
        step_s = time_call(stepped, device, max(1, args.reps // 2))
        print(f"| {t} | {t / chunked_s:,.0f} | {t / prefill_s:,.0f} | {t / step_s:,.0f} |")


if __name__ == "__main__":
    main()
