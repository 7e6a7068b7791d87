"""PNG figures of the benchmarks (tools/bench_cpu.py --plot DIR); matplotlib is the
`bench` extra. Each figure names the command and the machine it came from."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

PEER_STYLE = {"numpy": dict(color="0.35", linestyle="--"), "torch": dict(color="black",
                                                                          linestyle=":")}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e \".[bench]\"") from None
    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def attention_bandwidth(results: dict[str, Any], path: str, source: str) -> None:
    """GB/s of cache bytes read against context, one line per format and peer, one panel
    per thread count. results: tools/bench_attention.py main()'s return."""
    plt = _pyplot()
    times = results["times"]
    threads = sorted({t for _, t in times})
    fig, axes = plt.subplots(1, len(threads), figsize=(5.2 * len(threads), 4.2), sharey=True,
                             squeeze=False)
    for ax, t in zip(axes[0], threads):
        for (name, tt), per_n in times.items():
            if tt != t:
                continue
            ns = sorted(per_n)
            gbps = [per_n[n][1] / per_n[n][0] / 1e9 for n in ns]
            peer = next((s for p, s in PEER_STYLE.items() if name.startswith(p)), None)
            ax.plot(ns, gbps, marker="o", markersize=4, label=name.removeprefix("kvcore "),
                    **(peer or {}))
        probe = results.get("probe", {})
        rates = [[per_n[n][1] / per_n[n][0] / 1e9 for (_, tt), per_n in probe.items() if tt == t]
                 for n in ns]
        if probe:   # the streaming-read probe: median over the formats' bytes
            ax.plot(ns, [float(np.median(r)) for r in rates], color="red", linewidth=1.2,
                    linestyle="--", label="streaming-read probe")
        fma = results.get("fma", {}).get(t)
        if fma:   # the arithmetic limit: 2 * G * D = 1,024 multiply-adds per position and
            # kv head (G = 4, D = 128), over its 256 bytes of 8-bit codes or 512 of 16-bit
            for nbytes, style in ((256, "-."), (512, ":")):
                ax.axhline(fma / 1024 * nbytes / 1e9, color="purple", linewidth=1.0,
                           linestyle=style, label=f"FMA limit, {nbytes // 256 * 8}-bit codes")
        ax.axhline(results["copy_GBps"] / 2, color="red", linewidth=0.8, alpha=0.6,
                   label="np.copyto / 2 (read share)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [f"{n // 1024}k" for n in ns])
        ax.set_xlabel("context (positions)")
        ax.set_title(f"{t} thread{'s' if t > 1 else ''}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s of cache bytes read")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("Decode attention, 1 token, Hq=32 Hkv=8 D=128 (kvcore formats; peers f32)",
                 fontsize=10)
    _caption(fig, source)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def accuracy(results: dict[str, dict[str, float]], path: str, source: str) -> None:
    """Grouped bars of relative RMS error per format (log scale); exact results (0) are
    labelled instead. results: tools/bench_accuracy.py main()'s return."""
    plt = _pyplot()
    cols = ["round trip gauss", "round trip t(3)", "round trip K", "attention"]
    names = list(results)
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    width = 0.2
    for j, col in enumerate(cols):
        xs = [i + (j - 1.5) * width for i, name in enumerate(names)
              if results[name].get(col) not in (None, 0)]
        ax.bar(xs, [v for name in names if (v := results[name].get(col)) not in (None, 0)],
               width, color=f"C{j}", label=col)
    for i, name in enumerate(names):
        exact = [c for c in cols if results[name].get(c) == 0]
        if exact:
            ax.text(i - width / 2, 1.5e-7, "round trip\nexact" if len(exact) > 1 else "exact",
                    ha="center", va="bottom", fontsize=6.5)
    ax.set_yscale("log")
    ax.set_ylim(1e-7, 1)
    ax.set_xticks(range(len(names)), [n.removeprefix("kvcore ").replace(" attention", "\n(attention)")
                                      for n in names], fontsize=8)
    ax.set_ylabel("relative RMS error vs float64")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Accuracy per format: round trip, and decode attention (4096 positions)",
                 fontsize=10)
    _caption(fig, source)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def _caption(fig: Any, source: str) -> None:
    fig.text(0.01, -0.02, source, fontsize=7, ha="left", va="top", color="0.3")


def write(results: dict[str, Any], directory: str, source: str) -> list[str]:
    """The figures the sections run can draw, as PNGs in directory; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    if "attention" in results:
        paths.append(os.path.join(directory, "attention_bandwidth.png"))
        attention_bandwidth(results["attention"], paths[-1], source)
    if "accuracy" in results:
        paths.append(os.path.join(directory, "accuracy.png"))
        accuracy(results["accuracy"], paths[-1], source)
    return paths
