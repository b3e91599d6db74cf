"""Figures: per-channel key/value magnitudes (KVQuant Fig. 2), element distributions (Fig. 4),
and perplexity against context length (Fig. 3)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import DEFAULT_DEVICE, DEFAULT_DTYPE, InspectConfig
from ..methods import is_unquantized


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@torch.no_grad()
def capture_kv(model, ids: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Per layer pre-RoPE keys, post-RoPE keys (as the model caches them) and values [T, C] of ids [1, T]."""
    from ..integrations.parts import read_forward

    reads, cache = read_forward(model, ids.to(next(model.parameters()).device))
    out = {"k_pre": [], "k_post": [], "v": []}
    for i, layer in enumerate(cache.layers):
        out["k_pre"].append(reads[(i, "k")][0].float())
        out["k_post"].append(layer.keys[0].transpose(0, 1).reshape(ids.shape[1], -1).float())  # [H, T, D] -> [T, C]
        out["v"].append(reads[(i, "v")][0].float())
    return out


def inspect_activations(model_name: str, text_name: str, out_dir: str, layer: int | None = InspectConfig.layer,
                        seqlen: int = InspectConfig.seqlen, dtype: str = DEFAULT_DTYPE,
                        device: str = DEFAULT_DEVICE) -> list[Path]:
    """Write the per-channel magnitude plot for one layer and the per-layer distribution plot."""
    from ..integrations.loading import load_model
    from .texts import load_text, token_windows

    model, tok = load_model(model_name, dtype, device)
    ids = token_windows(tok, load_text(text_name).evaluation, seqlen, max_windows=1)
    acts = capture_kv(model, ids)
    n_layers = len(acts["v"])
    layer = n_layers // 2 if layer is None else layer
    if not 0 <= layer < n_layers:
        raise ValueError(f"--layer {layer} is out of range: the model has layers 0..{n_layers - 1}")
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    titles = {"k_pre": "keys, pre-RoPE", "k_post": "keys, post-RoPE", "v": "values"}
    for ax, name in zip(axes, ("k_pre", "k_post", "v")):
        mag = acts[name][layer].abs()  # [T, C]
        im = ax.imshow(mag.T.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(f"layer {layer}: |{titles[name]}|")
        ax.set_xlabel("token")
        ax.set_ylabel("channel")
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"{model_name}, {text_name}, {seqlen} tokens: outlier channels are stable across tokens "
                 "for keys (per-channel quantization), not for values")
    fig.tight_layout()
    p1 = out / f"channel_magnitudes_layer{layer}.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(max(8, n_layers * 0.4), 7), sharex=True)
    pos = list(range(n_layers))
    for ax, name in zip(axes, ("k_pre", "v")):
        data = [acts[name][i].flatten().numpy() for i in pos]
        # the box and whiskers hold 99% of the elements; the dots are the extremes the 1% outliers reach
        ax.boxplot(data, positions=pos, whis=(0.5, 99.5), showfliers=False)
        ax.scatter(pos, [d.max() for d in data], s=8, color="tab:red", label="max / min")
        ax.scatter(pos, [d.min() for d in data], s=8, color="tab:red")
        ax.set_ylabel(titles[name])
        ax.legend(loc="upper left")
    axes[1].set_xlabel("layer")
    axes[0].set_title(f"{model_name}: element distribution per layer (box: quartiles, whiskers: 0.5-99.5 percentile) "
                      "- the 1% tails stretch the range several times")
    fig.tight_layout()
    p2 = out / "magnitude_distribution_per_layer.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def plot_ppl_by_length(runs: list[dict], path: str) -> None:
    """One line per method: perplexity against window length (runs as written by `kvsqueeze eval --json`)."""
    plt = _plt()
    by_method: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        for row in run["rows"]:
            by_method.setdefault(row["method"], []).append((run["seqlen"], row["ppl"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, pts in by_method.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # baselines that fail by 5x would otherwise flatten the lines that matter
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    if runs:
        ax.set_title(f"{runs[0]['model']} on {runs[0]['text']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_budget(alloc, path: str) -> str:
    """Bits per layer of a bit budget (`kvsqueeze.methods.budget.Allocation`): keys and values side by side, the
    layers that keep 1% (or 0.1%) outliers hatched; with a width per channel (':chan'), each layer's mean width,
    and a second panel with every channel's width (layers down, channels across; keys left, values right)."""
    from ..methods.budget import CHANNEL_BITS

    plt = _plt()
    layers = range(len(alloc.keys))
    chan = any(c.widths is not None for c in alloc.keys + alloc.values)
    width = max(6.0, 0.28 * len(alloc.keys))
    if chan:
        fig, (ax, grid) = plt.subplots(2, 1, figsize=(width, 3.2 + 0.12 * len(alloc.keys)),
                                       gridspec_kw={"height_ratios": [3.2, 0.12 * len(alloc.keys)]})
    else:
        fig, ax = plt.subplots(figsize=(width, 3.2))
    sides = ((-0.2, alloc.keys, "keys", "#3b6ea8"), (0.2, alloc.values, "values", "#d08a2e"))
    for shift, choices, label, color in sides:
        bars = ax.bar([i + shift for i in layers], [c.mean_bits for c in choices], width=0.4, label=label,
                      color=color)
        for bar, c in zip(bars, choices):
            if c.fraction:
                bar.set_hatch("//" if c.fraction >= 0.01 else ".")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean bits" if chan else "bits")
    ax.set_yticks(list(range(1, max(CHANNEL_BITS) + 1)) if chan else [2, 3, 4])
    ax.set_ylim(0, (max(CHANNEL_BITS) if chan else 4) + 0.6)
    ax.set_title(f"nuq@{alloc.avg_bits:g}{':chan' if chan else ''}: {alloc.bits:.3f} bits per element at "
                 f"{alloc.tokens} tokens (hatched: outliers kept)")
    if chan:
        import numpy as np

        channels = len(next(c.widths for c in alloc.keys + alloc.values if c.widths is not None))

        def row(c) -> list[int]:  # a layer given one width for all its channels shows it in every channel
            return list(c.widths) if c.widths is not None else [c.bits] * channels

        widths = np.array([row(k) + row(v) for k, v in zip(alloc.keys, alloc.values)])
        shown = grid.imshow(widths, aspect="auto", cmap="viridis", vmin=1, vmax=max(CHANNEL_BITS), interpolation="nearest")
        grid.axvline(channels - 0.5, color="white", lw=1.5)
        grid.set_xlabel("channel (keys | values)")
        grid.set_ylabel("layer")
        fig.colorbar(shown, ax=grid, ticks=list(range(1, max(CHANNEL_BITS) + 1)), label="bits")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ruler(scores, path: str | Path, task: str = "average") -> Path:
    """Score against context length, one line per method and one panel per model (`ruler_eval.Score` rows)."""
    plt = _plt()
    rows = [s for s in scores if s.task == task]
    models = list(dict.fromkeys(s.model for s in rows))
    if not models:
        raise ValueError(f"no {task} scores to plot")
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [s for s in rows if s.model == model]
        for method in dict.fromkeys(s.method for s in mine):
            pts = sorted((s.length, s.score, s.ci95) for s in mine if s.method == method)
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], marker="o", label=method, lw=2.2 if is_unquantized(method) else 1.4)
            if all(p[2] for p in pts):
                ax.fill_between(xs, [p[2][0] for p in pts], [p[2][1] for p in pts], alpha=0.08)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({s.length for s in mine}), [f"{n // 1024}K" for n in sorted({s.length for s in mine})])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"{task} score (0-100)")
        ax.set_ylim(bottom=0)
        ax.set_title(model)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
