"""Ablation: the baseline, then one run per implementation detail flipped from its default.

    python scripts/ablate.py --script ppo_mlp.py --env-id CartPole-v1 --num-seeds 5 --out-dir ablations/cartpole
    python scripts/ablate.py --script ppo_mlp.py --out-dir DIR --details norm-adv clip-eps -- --num-total-env-steps 100000

Seeds run vmapped inside each run (--num-seeds). The baseline and every detail that is one value
the script's --sweep takes (norm-adv, clip-eps, ent-coef, ...) train together in one process, one
--sweep whose points are the baseline and each detail flipped alone (subfolder `sweep`, its
point-<i> the i-th of them); every other detail is a process of its own (subfolder `norm-obs`,
...), and so is everything when the script has no --sweep or refuses it. A run counts as finished
once it holds summary.json; --resume skips finished runs. Details whose flag the script lacks are
skipped with a note. Writes DIR/ablation.md, DIR/ablation.csv (with each row's run dir),
DIR/ablation.png (bars) and DIR/learning_curves.png.

Final return: per seed, the mean episodic return over the last 10% of cycles (the script's
summary.json); AUC: per seed, the mean episodic return over all cycles. Both as mean ± sample
std over seeds, relative to the baseline's mean, and as Agarwal et al. (2021) recommend (see
runlib.py): the interquartile mean (IQM) over seeds with a 95% bootstrap confidence interval, and
the probability of improvement P(detail > baseline), the chance that a random seed of the detail
beats a random seed of the baseline (ties count half). A detail is marked a finding (`lower
final`, `higher AUC`, ...) only when its IQM's CI excludes the baseline's IQM.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import (  # noqa: E402
    STAT_CSV_COLUMNS,
    Comparison,
    area_under_curve,
    check_out_dir,
    compare_scores,
    default_window,
    draw_curve,
    env_ids,
    finite_scores,
    flags_for,
    fmt,
    format_probability,
    label_axes,
    mean_std,
    metric_table,
    pyplot,
    read_run,
    run_once,
    load_script,
    script_defaults,
    script_file,
    split_passthrough,
)
from ppo_support import sweeps  # noqa: E402  (runlib put the repository on the path)

HUGE_GRAD_NORM = 1e9  # global-norm clipping never triggers


class Detail(NamedTuple):
    name: str
    fields: tuple[str, ...]  # the first of these the script has is flipped
    flipped: Callable[[Any], Any]  # default -> ablated value
    note: str


def other_clip_eps(default: float) -> float:
    return 0.1 if default != 0.1 else 0.2


DETAILS = (
    Detail("anneal-lr", ("anneal_lr",), lambda default: not default, "learning-rate annealing toggled (37 details: 4)"),
    Detail("clip-eps", ("clip_eps",), other_clip_eps, "clip range 0.1 <-> 0.2 (37 details: 8)"),
    Detail("clip-vloss", ("clip_vloss",), lambda default: not default, "value-loss clipping toggled (37 details: 9)"),
    Detail("norm-adv", ("norm_adv",), lambda default: not default, "advantage normalization toggled (37 details: 7)"),
    Detail("orthogonal-init", ("orthogonal_init",), lambda default: not default, "orthogonal init toggled (37 details: 2)"),
    Detail("adam-eps", ("adam_eps",), lambda default: 1e-8, "Adam eps 1e-8, PyTorch's default (37 details: 3)"),
    Detail("ent-coef", ("ent_coef",), lambda default: 0.0, "no entropy bonus (37 details: 10)"),
    Detail("max-grad-norm", ("max_grad_norm",), lambda default: HUGE_GRAD_NORM, "global gradient clipping off (37 details: 11)"),
    Detail("shared-network", ("shared_network", "separate_critic"), lambda default: not default,
           "shared vs separate actor/critic toggled (37 details: 13)"),
    Detail("minibatches-1", ("num_minibatches_per_epoch",), lambda default: 1, "one minibatch per epoch (37 details: 6)"),
    Detail("minibatches-2x", ("num_minibatches_per_epoch",), lambda default: 2 * default, "twice the minibatches per epoch"),
    Detail("anneal-clip-eps", ("anneal_clip_eps",), lambda default: not default, "clip-range annealing toggled"),
    Detail("target-kl", ("target_kl",), lambda default: 0.01 if default is None else None, "early stop at approxkl3 > 0.01"),
    Detail("bootstrap-truncated", ("bootstrap_truncated",), lambda default: not default,
           "bootstrapping truncated episodes from V(final obs) toggled"),
    Detail("frame-stack", ("frame_stack",), lambda default: 4 if default == 1 else 1, "4 stacked frames (vs 1)"),
    Detail("lstm-training", ("lstm_training",), lambda default: "stored" if default == "bptt" else "bptt",
           "LSTM trained by BPTT vs from stored carries"),
    Detail("norm-obs", ("norm_obs",), lambda default: not default, "observation normalisation toggled (37 details: 28, 29)"),
    Detail("norm-reward", ("norm_reward",), lambda default: not default, "reward scaling toggled (37 details: 30)"),
    Detail("sticky-actions", ("sticky_action_prob",), lambda default: 0.1 if default == 0 else 0.0,
           "sticky actions with p = 0.1 (MinAtar's own default; vs none)"),
    Detail("torso", ("torso",), lambda default: "impala" if default == "nature" else "nature",
           "Nature CNN vs IMPALA CNN torso (37 details: 21)"),  # --torso auto is impala on images
)
DETAIL_NAMES = [detail.name for detail in DETAILS]


SWEEP_RUN = "sweep"  # the subfolder of the --sweep that trains the baseline and the sweepable details


def swept_details(planned: list[tuple[str, list[str], str]], defaults: dict[str, Any],
                  sweepable: tuple[str, ...]) -> list[tuple[str, str, Any]]:
    """(name, field, flipped value) of each planned detail that one --sweep can train beside the
    baseline: one field the sweep takes, with a value other than the default (not None)."""
    if "sweep" not in defaults:
        return []
    details = {detail.name: detail for detail in DETAILS}
    swept = []
    for name, _, _ in planned[1:]:
        field = next(field for field in details[name].fields if field in defaults)
        value = details[name].flipped(defaults[field])
        if field in sweepable and None not in (value, defaults[field]) and value != defaults[field]:
            swept.append((name, field, value))
    return swept


def sweep_flags(swept: list[tuple[str, str, Any]], defaults: dict[str, Any]) -> list[str]:
    """--sweep with one axis of all the swept fields together (values joined by colons): the
    baseline's point, then one point per detail with only its field flipped."""
    fields = [field for _, field, _ in swept]
    points = [[defaults[field] for field in fields]]
    points += [[value if other == field else defaults[other] for other in fields] for _, field, value in swept]
    text = lambda value: str(value).lower() if isinstance(value, bool) else repr(float(value))  # noqa: E731
    return ["--sweep", ",".join(fields) + "=" + ",".join(":".join(text(value) for value in point) for point in points)]


def detail_flags(detail: Detail, defaults: dict[str, Any]) -> tuple[list[str], str] | tuple[None, str]:
    """The flags that flip a detail for this script, and a `field=value` description; None and a
    note when the script has no such flag."""
    for field in detail.fields:
        if field in defaults:
            value = detail.flipped(defaults[field])
            return flags_for(field, value), f"{field}={value}"
    return None, f"skipped: the script has no {' / '.join('--' + f.replace('_', '-') for f in detail.fields)}"


METRICS = {"final": "final", "auc": "AUC"}  # row key: name in the finding column


def summarize(run_dir: Path) -> dict[str, Any]:
    """Per metric (final, auc): mean ± std, and the finite scores per seed (key `final_per_seed`)."""
    run = read_run(run_dir)
    per_seed = {"final": finite_scores(run.summary["final_episodic_return_per_seed"]),
                "auc": finite_scores(area_under_curve(run))}
    return {"run": run, "num_seeds": run.args.get("num_seeds", 1),
            **{key: mean_std(scores) for key, scores in per_seed.items()},
            **{f"{key}_per_seed": scores for key, scores in per_seed.items()}}


def findings(comparisons: dict[str, Comparison]) -> str:
    """e.g. `lower final, lower AUC`; empty when no CI excludes the baseline."""
    return ", ".join(f"{comparison.finding} {METRICS[key]}" for key, comparison in comparisons.items() if comparison.finding)


STATISTICS_NOTE = (
    "IQM: the mean of the middle 50% of seeds (int(n/4) cut from each end), with a 95% percentile bootstrap CI over "
    "seeds; P(final > baseline), P(AUC > baseline): the probability that a random seed of the row beats one of the "
    "baseline (ties count half), with its 95% bootstrap CI (Agarwal et al. 2021). A finding only where the IQM's CI "
    "excludes the baseline's IQM."
)


def relative(value: float, baseline: float) -> float:
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline == 0:
        return math.nan
    return 100.0 * (value - baseline) / abs(baseline)


def write_outputs(out_dir: Path, rows: list[dict[str, Any]], header: str) -> None:
    baseline = rows[0]
    comparisons = {row["detail"]: {key: compare_scores(row[f"{key}_per_seed"], baseline[f"{key}_per_seed"], row is baseline)
                                   for key in METRICS}
                   for row in rows if "final" in row}
    stat_columns = [f"{key}_{name}" for key in METRICS for name in STAT_CSV_COLUMNS]
    csv_columns = ["detail", "change", "status", "run_dir", "final_mean", "final_std", "final_rel_pct", "auc_mean", "auc_std", "auc_rel_pct",
                   "num_seeds", *stat_columns, "finding"]
    with open(out_dir / "ablation.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=csv_columns)
        writer.writeheader()
        for row in rows:
            record = {"detail": row["detail"], "change": row["change"], "status": row["status"]}
            if "final" in row:
                record.update(
                    run_dir=row["run"].path.relative_to(out_dir).as_posix(),
                    final_mean=f"{row['final'][0]:.2f}", final_std=f"{row['final'][1]:.2f}",
                    final_rel_pct=f"{relative(row['final'][0], baseline['final'][0]):.1f}",
                    auc_mean=f"{row['auc'][0]:.2f}", auc_std=f"{row['auc'][1]:.2f}",
                    auc_rel_pct=f"{relative(row['auc'][0], baseline['auc'][0]):.1f}", num_seeds=row["num_seeds"],
                    finding=findings(comparisons[row["detail"]]),
                )
                for key, comparison in comparisons[row["detail"]].items():
                    record.update(comparison.csv_record(key))
            writer.writerow(record)

    lines = [header, "",
             "| detail | change | final return | vs baseline | final IQM [95% CI] | P(final > baseline) "
             "| AUC (mean return, all cycles) | vs baseline | AUC IQM [95% CI] | P(AUC > baseline) | finding |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for row in rows:
        if "final" not in row:
            notes.append(f"- `{row['detail']}`: {row['status']}")
            continue
        cells = [row["detail"], f"`{row['change']}`"]
        for key, comparison in comparisons[row["detail"]].items():
            change = relative(row[key][0], baseline[key][0])
            cells += [f"{fmt(row[key][0])} ± {fmt(row[key][1])}", "-" if row is baseline else f"{change:+.1f}%",
                      f"{fmt(comparison.iqm)} [{fmt(comparison.iqm_ci[0])}, {fmt(comparison.iqm_ci[1])}]",
                      "-" if row is baseline else format_probability(comparison.p_improve, comparison.p_improve_ci)]
        finding = findings(comparisons[row["detail"]])
        cells.append("-" if row is baseline else f"**{finding}**" if finding else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", STATISTICS_NOTE]
    if notes:
        lines += ["", "Not run:", "", *notes]
    (out_dir / "ablation.md").write_text("\n".join(lines) + "\n")

    finished = [row for row in rows if "final" in row]
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 0.38 * len(finished) + 1.6), sharey=True)
    positions = np.arange(len(finished))[::-1]
    for ax, key, title in zip(axes, ["final", "auc"], ["final return (last 10% of cycles)", "AUC (mean return over all cycles)"]):
        means = [row[key][0] for row in finished]
        stds = [row[key][1] for row in finished]
        colors = ["tab:gray" if row is baseline else "tab:blue" for row in finished]
        ax.barh(positions, means, xerr=stds, color=colors, capsize=3)
        ax.axvline(baseline[key][0], color="black", linestyle="--", linewidth=0.8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(positions, [row["detail"] for row in finished], fontsize=8)
    figure.suptitle(f"{env_ids([row['run'] for row in finished])}: mean ± std over {baseline['num_seeds']} seeds; "
                    "dashed: baseline", fontsize=9)
    figure.tight_layout()
    figure.savefig(out_dir / "ablation.png", dpi=110)
    plt.close(figure)

    plot_against_baseline(finished, out_dir / "learning_curves.png")


def plot_against_baseline(rows: list[dict[str, Any]], out: Path, metric: str = "charts/episodic_return") -> None:
    """One panel per detail: its learning curve against the baseline's (mean ± std over seeds)."""
    baseline, details = rows[0], rows[1:] or rows[:1]
    plt = pyplot()
    window = default_window([row["run"] for row in rows])
    num_columns = min(len(details), 4)
    num_rows = math.ceil(len(details) / num_columns)
    figure, axes = plt.subplots(num_rows, num_columns, figsize=(3.6 * num_columns, 2.6 * num_rows + 0.5),
                                sharex=True, sharey=True, squeeze=False)
    base_steps, base_values, _ = metric_table(baseline["run"], metric)
    for index, (ax, row) in enumerate(zip(axes.flat, details)):
        draw_curve(ax, base_steps, base_values, "baseline", "std", window, color="tab:gray")
        env_steps, values, _ = metric_table(row["run"], metric)
        draw_curve(ax, env_steps, values, row["detail"], "std", window, color="tab:blue")
        ax.set_title(f"{row['detail']}: {row['change']}", fontsize=8)
        first_column, last_row = index % num_columns == 0, index >= len(details) - num_columns
        label_axes(ax, "env steps (per seed)" if last_row else "", metric if first_column else None)
    for ax in list(axes.flat)[len(details) :]:
        ax.axis("off")
    smoothing = f", moving average of {window} cycles" if window > 1 else ""
    figure.suptitle(f"{env_ids([row['run'] for row in rows])}: {metric}; blue: detail flipped, gray: baseline; "
                    f"mean ± std over {baseline['num_seeds']} seeds{smoothing}", fontsize=9)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    ours, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s --script SCRIPT --out-dir DIR [options] [-- flags for every run]")
    parser.add_argument("--script", default="ppo_mlp.py",
                        help="the training script: a name in the repo root, or the path of a copy anywhere")
    parser.add_argument("--env-id", help="passed to every run (default: the script's)")
    parser.add_argument("--num-seeds", type=int, default=5, help="seeds per run, vmapped in one process")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--details", nargs="+", choices=DETAIL_NAMES, metavar="DETAIL",
                        help=f"a subset of: {', '.join(DETAIL_NAMES)} (default: all)")
    parser.add_argument("--resume", action="store_true", help="skip runs that already finished in --out-dir")
    options = parser.parse_args(ours)
    try:
        script = str(script_file(options.script))
    except FileNotFoundError as error:
        parser.error(str(error))
    if options.num_seeds < 1:
        parser.error(f"--num-seeds must be >= 1, got {options.num_seeds}")
    error = check_out_dir(options.out_dir, options.resume)
    if error:
        parser.error(error)

    defaults = script_defaults(script)
    common = ["--num-seeds", str(options.num_seeds)] + (["--env-id", options.env_id] if options.env_id else [])
    planned = [("baseline", [], "(defaults)")]
    skipped = []
    for detail in DETAILS:
        if options.details and detail.name not in options.details:
            continue
        flags, change = detail_flags(detail, defaults)
        if flags is None:
            skipped.append({"detail": detail.name, "change": "", "status": change})
            print(f"{detail.name}: {change}", flush=True)
        else:
            planned.append((detail.name, flags, change))

    rows = []
    swept = swept_details(planned, defaults, getattr(load_script(script).Args, "sweepable", ()))
    if swept:  # the baseline and these details in one process
        result = run_once(script, common + sweep_flags(swept, defaults), options.out_dir / SWEEP_RUN, extra)
        if result.status == "rejected":
            print(f"one --sweep for {', '.join(name for name, _, _ in swept)} rejected by {options.script} "
                  f"({result.message}): one process per detail", flush=True)
        else:
            names = ["baseline", *[name for name, _, _ in swept]]
            changes = {name: change for name, _, change in planned}
            for index, name in enumerate(names):
                run_dir = options.out_dir / SWEEP_RUN / sweeps.POINT_DIR.format(index=index)
                row = {"detail": name, "change": changes[name], "status": f"{result.status} (in one --sweep)",
                       **summarize(run_dir)}
                rows.append(row)
                print(f"{name} ({row['status']}): final {fmt(row['final'][0])} ± {fmt(row['final'][1])}, "
                      f"AUC {fmt(row['auc'][0])} ± {fmt(row['auc'][1])}", flush=True)
            done = set(names)
            planned = [plan for plan in planned if plan[0] not in done]
    for name, flags, change in planned:
        result = run_once(script, common + flags, options.out_dir / name, extra)
        if result.status == "rejected":
            rows.append({"detail": name, "change": change, "status": f"rejected by the script: {result.message}"})
            print(f"{name}: rejected by {options.script}: {result.message}", flush=True)
            if name == "baseline":
                print(f"error: the baseline itself is rejected: {result.message}", file=sys.stderr)
                return 2
            continue
        row = {"detail": name, "change": change, "status": result.status, **summarize(options.out_dir / name)}
        rows.append(row)
        print(f"{name} ({result.status}): final {fmt(row['final'][0])} ± {fmt(row['final'][1])}, "
              f"AUC {fmt(row['auc'][0])} ± {fmt(row['auc'][1])}", flush=True)

    env_id = options.env_id or defaults["env_id"]
    header = (f"Ablation of `{options.script}` on {env_id}, {options.num_seeds} seeds per run"
              f"{', extra flags `' + ' '.join(extra) + '`' if extra else ''}. Final return: mean over the last 10% "
              f"of cycles; AUC: mean over all cycles; each mean ± std over seeds.")
    write_outputs(options.out_dir, rows + skipped, header)
    print((options.out_dir / "ablation.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
