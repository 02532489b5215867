"""``openmsa eval``'s outputs: a table on the terminal, ``eval.json`` and ``accuracy.png``
(accuracy against length per task, dense and MSA)."""

from __future__ import annotations

import json
import os


def _cell(value, fmt="{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def print_table(rows: list[dict]) -> None:
    """Accuracy per task and length, dense beside MSA, with MSA's recalls."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by_key = {(r["task"], r["length"], r["mode"]): r for r in rows}
    print(f"{'task':>18} {'length':>7} {'dense':>6} {'msa':>6} {'msa-dense':>9} "
          f"{'block rec.':>10} {'mass rec.':>9}")
    for task in tasks:
        for length in lengths:
            dense, msa = by_key.get((task, length, "dense")), by_key.get((task, length, "msa"))
            if dense is None and msa is None:
                continue
            delta = (msa["accuracy"] - dense["accuracy"]) if dense and msa else None
            print(f"{task:>18} {length:>7} {_cell(dense and dense['accuracy']):>6} "
                  f"{_cell(msa and msa['accuracy']):>6} {_cell(delta, '{:+.3f}'):>9} "
                  f"{_cell(msa and msa['block_recall']):>10} "
                  f"{_cell(msa and msa['mass_recall']):>9}")


def write_json(path: str, settings: dict, rows: list[dict], results: list[dict]) -> None:
    with open(path, "w") as handle:
        json.dump({"settings": settings, "summary": rows, "samples": results}, handle,
                  indent=1)


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """Accuracy against length, one panel per task (and the average), dense and MSA; returns
    the path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    columns = min(4, len(tasks))
    lines = -(-len(tasks) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(3.2 * columns, 2.6 * lines),
                                squeeze=False, sharey=True)
    for axis, task in zip(axes.flat, tasks):
        for mode, style in (("dense", "o-"), ("msa", "s--")):
            points = sorted((r["length"], r["accuracy"]) for r in rows
                            if r["task"] == task and r["mode"] == mode)
            if points:
                axis.plot(*zip(*points), style, label=mode)
        axis.set_xscale("log", base=2)
        axis.set_title(task, fontsize=9)
        axis.set_ylim(-0.05, 1.05)
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(tasks):]:
        axis.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    for axis in axes[-1]:
        axis.set_xlabel("prompt tokens")
    for axis in axes[:, 0]:
        axis.set_ylabel("accuracy")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
