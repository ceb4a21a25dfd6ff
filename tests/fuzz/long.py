"""``make fuzz``: draws jobs until a time budget ends, and writes the coverage table.

    FUZZ_MINUTES=30 FUZZ_SEED=1000 [FUZZ_GROUPS=tf_local,torch] [FUZZ_CHUNK=5] [FUZZ_OUT=DIR] \\
        .venv/bin/python tests/fuzz/long.py

Each group (groups.GROUPS) takes the next FUZZ_CHUNK seeds in turn, in one process start, the groups round-robin,
all groups on the same seeds; a job whose group timed out in it runs once more, alone. Every record goes to
FUZZ_OUT/records.jsonl; each defect prints its seed and figure and writes a standalone script to FUZZ_OUT/defects/.
FUZZ_RECORDS=records.jsonl writes the table of an earlier run only. The table goes to docs/fuzzing-table.md
(FUZZ_TABLE=path).
"""

import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuzz.compare import figure, tolerance  # noqa: E402
from fuzz.grammar import draw_job, features  # noqa: E402
from fuzz.groups import GROUPS, environment_text, launcher_text, run_group  # noqa: E402
from fuzz.source import script  # noqa: E402
from helpers import ROOT  # noqa: E402

SHORT = {"DEFECT: raw error": "raw", "DEFECT: silent": "silent", "refused": "refused", "invalid": "invalid",
         "rounding": "rounding", "exact": "exact", "not run": "not run"}


def write_defect(record, out_dir):
    job = draw_job(record["seed"], record["backend"])
    group = record["group"]
    folder = os.path.join(out_dir, "defects")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"seed{record['seed']}-{group}-{record['word']}.py")
    launcher = (environment_text(group) + " " if environment_text(group) else "") + launcher_text(group)
    with open(path, "w") as f:
        f.write(script(job, record["word"], tolerance(job), launcher))
    return path


def describe(record):
    if record.get("error"):
        return record["error"].splitlines()[0][:160]
    return f"{figure(record['worst'])} at {record['where']}"


def fuzz(minutes, first_seed, groups, chunk, out_dir):
    deadline = time.monotonic() + 60 * minutes
    queues = {group: [] for group in groups}
    next_seed = {group: first_seed for group in groups}
    records, retried = [], set()
    while time.monotonic() < deadline:
        for group in groups:
            if time.monotonic() >= deadline:
                break
            alone = bool(queues[group]) and (group, queues[group][0]) in retried
            take = 1 if alone else chunk  # a job retried after a timeout runs alone, with a whole start's time
            seeds = queues[group][:take]
            while len(seeds) < take:
                seeds.append(next_seed[group])
                next_seed[group] += 1
            queues[group] = queues[group][take:]
            results, seconds = run_group(group, seeds, out_dir)
            print(f"[fuzz] {group} seeds {seeds[0]}..{seeds[-1]}: {seconds:.0f} s", flush=True)
            for (seed, word), record in sorted(results.items()):
                timed_out = "(timed out)" in (record.get("error") or "")
                if timed_out and (group, seed) not in retried:  # the group's limit, maybe the machine's load:
                    retried.add((group, seed))                  # once more, alone
                    queues[group].insert(0, seed)
                    print(f"[fuzz] {group} seed {seed}: its group timed out in it; run again", flush=True)
                    continue
                if record["outcome"] == "not run":
                    if seed not in queues[group]:
                        queues[group].append(seed)
                    continue
                if record["outcome"].startswith("DEFECT"):
                    record["script"] = write_defect(record, out_dir)
                    print(f"[fuzz] {record['outcome']}: seed {seed} {group} {word}: {describe(record)}; "
                          f"script {record['script']}", flush=True)
                records.append(record)
                with open(os.path.join(out_dir, "records.jsonl"), "a") as f:
                    f.write(json.dumps(record) + "\n")
    return records


def cell(records):
    counts = collections.Counter(SHORT[r["outcome"]] for r in records)
    worst = max((r.get("worst") or 0.0 for r in records if r["outcome"] in ("exact", "DEFECT: silent")), default=None)
    text = " ".join(f"{counts[k]} {k}" for k in ("exact", "rounding", "refused", "silent", "raw", "invalid")
                    if counts[k])
    return f"{len(records)}: {text}" + ("" if worst is None else f"; worst {figure(worst)}")


def _figure(worst):
    return "-" if worst is None else figure(worst)


def table(records, minutes, first_seed):
    words = sorted({f"{r['group']}:{r['word']}" for r in records})
    by_word = collections.defaultdict(list)
    by_feature = collections.defaultdict(lambda: collections.defaultdict(list))
    for record in records:
        key = f"{record['group']}:{record['word']}"
        by_word[key].append(record)
        for feature in features(draw_job(record["seed"], record["backend"])):
            by_feature[feature][key].append(record)
    lines = [f"Jobs drawn from seed {first_seed}, {minutes} minutes: {len(records)} runs "
             f"({len({(r['seed'], r['backend']) for r in records})} jobs). A cell: runs: outcomes; the worst "
             "difference of the runs that finished (tolerance: compare.TOLERANCES).", "",
             "| word | runs |", "|---|---|"]
    lines += [f"| {word} | {cell(by_word[word])} |" for word in words]
    lines += ["", "| drawn | " + " | ".join(words) + " |", "|---" * (len(words) + 1) + "|"]
    for feature in sorted(by_feature):
        lines.append(f"| {feature} | " + " | ".join(cell(by_feature[feature][w]) if by_feature[feature][w] else "-"
                                                    for w in words) + " |")
    defects = [r for r in records if r["outcome"].startswith("DEFECT")]
    lines += ["", f"Defects: {len(defects)}", "", "| seed | word | outcome | figure | script |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['group']}:{r['word']} | {r['outcome']} | {describe(r).replace('|', '/')} | "
              f"{os.path.basename(r.get('script', ''))} |" for r in defects]
    rounding = [r for r in records if r["outcome"] == "rounding"]
    if rounding:
        lines += ["", f"Rounding, not a defect: {len(rounding)} (compare.within_rounding)", "",
                  "| seed | word | figure | one process with other kernels | float32 twin | epsilon 1e-3 twin |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['seed']} | {r['group']}:{r['word']} | {describe(r)} | {_figure(r.get('floor'))} | "
                  f"{_figure(r.get('float32_worst'))} | {_figure(r.get('epsilon_worst'))} |" for r in rounding]
    return "\n".join(lines) + "\n"


def main():
    minutes = float(os.environ.get("FUZZ_MINUTES", "10"))
    first_seed = int(os.environ.get("FUZZ_SEED", "1000"))
    groups = [g for g in os.environ.get("FUZZ_GROUPS", ",".join(GROUPS)).split(",") if g]
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        sys.exit(f"FUZZ_GROUPS: unknown {unknown}; known: {sorted(GROUPS)}")
    out_dir = os.environ.get("FUZZ_OUT") or os.path.join("/tmp", f"kerasdist-fuzz-{int(time.time())}")
    os.makedirs(out_dir, exist_ok=True)
    if os.environ.get("FUZZ_RECORDS"):  # only the table, from a run's records.jsonl
        with open(os.environ["FUZZ_RECORDS"]) as f:
            records = [json.loads(line) for line in f]
    else:
        records = fuzz(minutes, first_seed, groups, int(os.environ.get("FUZZ_CHUNK", "5")), out_dir)
    text = table(records, minutes, first_seed)
    path = os.environ.get("FUZZ_TABLE", os.path.join(ROOT, "docs", "fuzzing-table.md"))
    with open(path, "w") as f:
        f.write("# Fuzzing coverage (written by `make fuzz`; docs/fuzzing.md explains it)\n\n" + text)
    print(text)
    print(f"records: {out_dir}/records.jsonl; table: {path}")
    return 1 if any(r["outcome"].startswith("DEFECT") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
