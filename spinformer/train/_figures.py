"""Loss, accuracy, solver-step, per-layer local-loss and entropy-production figures (PNG
files, drawn without pyplot)."""

from __future__ import annotations

import pathlib


class _Figures:
    """`subplots`/`close` on bare `matplotlib.figure.Figure`s: the run's PNGs are drawn without
    pyplot, so training inside a notebook leaves its inline backend alone (selecting Agg
    there would silently hide every later figure)."""

    @staticmethod
    def subplots(*args, figsize=None, **kwargs):
        from matplotlib.figure import Figure

        fig = Figure(figsize=figsize)
        return fig, fig.subplots(*args, **kwargs)

    @staticmethod
    def close(fig) -> None:
        del fig


def _plt():
    return _Figures


def _series(records, split, key):
    pts = [(r["step"], r[key]) for r in records if r.get("split") == split and key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def skipped_steps(records) -> list[tuple[int, int]]:
    """`[(step, skipped)]`: the logged train steps at which the count of skipped steps
    (`bad_steps`, cumulative) had grown since the previous logged step, and by how much."""
    out, last = [], 0
    for r in records:
        if r.get("split") == "train" and "bad_steps" in r:
            if r["bad_steps"] > last:
                out.append((int(r["step"]), int(r["bad_steps"] - last)))
            last = r["bad_steps"]
    return out


def layers_of(records, name: str = "solver_steps") -> list[int]:
    """The layers with a per-layer metric `name` (`solver_steps/0`, ...) in `records`."""
    keys = {k for r in records for k in r if k.startswith(name + "/")}
    return sorted(int(k.split("/", 1)[1]) for k in keys)


# per-layer metrics drawn one line per layer, train and validation: (name, y label)
_PER_LAYER = (("local_loss", "local cross-entropy"), ("entropy_production", "entropy production σ"))


def plot_run(records: list[dict], out_dir, *, title: str = "",
             baselines: "dict | None" = None) -> list[pathlib.Path]:
    """Write `loss.png` and `accuracy.png` (train and validation vs step) into `out_dir`,
    `solver_steps.png` (forward solver steps per layer vs step, and the backward solves'
    matrix-vector products where the linear solver counts them) for models that solve fixed
    points, `local_loss.png` (each layer's own cross-entropy vs step) for runs with local
    losses, and `entropy_production.png` (per layer vs step) for models that report it.
    `title` (e.g. the run's name) heads every figure; `baselines` (the dataset's reference
    accuracies, `summary.json`'s "baselines") are drawn as grey lines on the accuracy
    figure."""
    return plot_runs({"": records}, out_dir, title=title, baselines=baselines)


def plot_runs(runs: dict[str, list[dict]], out_dir, prefix: str = "", *, title: str = "",
              baselines: "dict | None" = None) -> list[pathlib.Path]:
    """Figures comparing several runs (`{label: records}`): `{prefix}loss.png`,
    `{prefix}accuracy.png` (in %, with the `baselines` accuracies, e.g. chance, as grey
    lines), and, one panel per run and one line per layer, `{prefix}solver_steps.png`,
    `{prefix}local_loss.png` and `{prefix}entropy_production.png` if any run logged that
    metric per layer. Steps skipped for a non-finite loss or gradient are marked on the loss
    and accuracy figures; `title` heads every figure."""
    plt = _plt()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, ylabel in (("loss", "loss (cross-entropy; MSE per pixel for reconstruction)"),
                        ("accuracy", "accuracy (%)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        scale = 100.0 if key == "accuracy" else 1.0
        for i, (label, records) in enumerate(runs.items()):
            color = f"C{i}"
            for split, style in (("train", ":"), ("val", "-")):
                xs, ys = _series(records, split, key)
                if xs:
                    name = f"{label} {split}".strip()
                    ax.plot(xs, [scale * y for y in ys], style, color=color, label=name)
            skipped = skipped_steps(records)
            if skipped:  # where steps were skipped (non-finite loss or gradient)
                total = sum(n for _, n in skipped)
                for j, (s, _) in enumerate(skipped):
                    ax.axvline(s, color=color, alpha=0.35, lw=0.8, ls="--",
                               label=(f"{label} {total} skipped steps (dashed: logged "
                                      f"steps after them)".strip() if j == 0 else None))
        if key != "loss" and not ax.has_data():  # e.g. no accuracy: a reconstruction run
            plt.close(fig)
            continue
        if key == "accuracy":
            for j, (name, value) in enumerate(sorted((baselines or {}).items())):
                if name.endswith("_accuracy"):
                    ax.axhline(100.0 * value, color="0.5", lw=0.9, ls=("--", "-.", ":")[j % 3],
                               label=name.replace("_accuracy", "").replace("_", " "))
        if title:
            ax.set_title(title, fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ax.has_data():
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = out / f"{prefix}{key}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    solved = {label: records for label, records in runs.items() if layers_of(records)}
    if solved:
        paths.append(_plot_solver_steps(plt, solved, out / f"{prefix}solver_steps.png",
                                        title))
    for name, ylabel in _PER_LAYER:
        logged = {label: records for label, records in runs.items()
                  if layers_of(records, name)}
        if logged:
            paths.append(_plot_per_layer(plt, logged, name, ylabel, out / f"{prefix}{name}.png",
                                         title=title))
    return paths


def _plot_per_layer(plt, runs: dict[str, list[dict]], name: str, ylabel: str,
                    path: pathlib.Path, extra=None, title: str = "") -> pathlib.Path:
    """One panel per run, one colour per layer: `name/<layer>` for train (dotted) and val
    (solid); `extra(ax, records, layer)` draws more per layer."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(6, 3 * len(runs)), squeeze=False,
                             sharex=True)
    for ax, (label, records) in zip(axes[:, 0], runs.items()):
        for layer in layers_of(records, name):
            for split, style in (("train", ":"), ("val", "-")):
                xs, ys = _series(records, split, f"{name}/{layer}")
                if xs:
                    ax.plot(xs, ys, style, color=f"C{layer}", label=f"layer {layer} {split}")
            if extra is not None:
                extra(ax, records, layer)
        ax.set_ylabel(ylabel)
        heading = " — ".join(t for t in (title, label) if t)
        if heading:
            ax.set_title(heading, fontsize="small")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _backward_products(ax, records, layer) -> None:
    """Matrix-vector products per adjoint solve (negative where the linear solver does not
    count them, BiCGStab: not drawn)."""
    xs, ys = _series(records, "train", f"backward_steps/{layer}")
    pts = [(x, y) for x, y in zip(xs, ys) if y >= 0]
    if pts:
        ax.plot(*zip(*pts), "--", color=f"C{layer}", label=f"layer {layer} backward products")


def _plot_solver_steps(plt, runs: dict[str, list[dict]], path: pathlib.Path,
                       title: str = "") -> pathlib.Path:
    return _plot_per_layer(plt, runs, "solver_steps",
                           "forward steps per solve;\nbackward products (dashed)", path,
                           extra=_backward_products, title=title)
