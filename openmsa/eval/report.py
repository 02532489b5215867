"""``openmsa eval``'s outputs: a table on the terminal, ``eval.json`` and ``accuracy.png``
(accuracy and answer-token accuracy against length per task, dense and MSA)."""

from __future__ import annotations

import itertools
import json
import os


def _cell(value, fmt="{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def print_table(rows: list[dict]) -> None:
    """Accuracy per task and length, dense beside MSA, then the answer-token accuracy
    (teacher-forced) likewise, with MSA's recalls."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by_key = {(r["task"], r["length"], r["mode"]): r for r in rows}
    print(f"{'':>26} {'accuracy':^22} {'answer tokens':^22}")
    print(f"{'task':>18} {'length':>7} {'dense':>6} {'msa':>6} {'msa-dense':>9} {'dense':>6} "
          f"{'msa':>6} {'msa-dense':>9} {'block rec.':>10} {'mass rec.':>9}")
    for task in tasks:
        for length in lengths:
            dense, msa = by_key.get((task, length, "dense")), by_key.get((task, length, "msa"))
            if dense is None and msa is None:
                continue
            cells = []
            for key in ("accuracy", "token_accuracy"):
                delta = (msa[key] - dense[key]) if dense and msa else None
                cells.append(f"{_cell(dense and dense[key]):>6} {_cell(msa and msa[key]):>6} "
                             f"{_cell(delta, '{:+.3f}'):>9}")
            print(f"{task:>18} {length:>7} {cells[0]} {cells[1]} "
                  f"{_cell(msa and msa['block_recall']):>10} "
                  f"{_cell(msa and msa['mass_recall']):>9}")


def write_json(path: str, settings: dict, rows: list[dict], results: list[dict]) -> None:
    with open(path, "w") as handle:
        json.dump({"settings": settings, "summary": rows, "samples": results}, handle,
                  indent=1)


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """Accuracy (and, fainter, the answer-token accuracy) against length, one panel per task
    (and the average), dense and MSA; returns the path, or None without matplotlib."""
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
        for (mode, style), (key, alpha, name) in itertools.product(
                (("dense", "o-"), ("msa", "s--")),
                (("accuracy", 1.0, ""), ("token_accuracy", 0.4, ", answer tokens"))):
            points = sorted((r["length"], r[key]) for r in rows
                            if r["task"] == task and r["mode"] == mode and r.get(key) is not None)
            if points:
                axis.plot(*zip(*points), style, alpha=alpha, label=mode + name)
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
