"""A Slurm job step's cluster, read from the step's own variables (no TensorFlow).

``srun --ntasks N python train.py`` starts one worker per task. Each task's place is derived from the step's
node list (in Slurm's order), its tasks per node and its distribution (block by default, ``-m cyclic``), then
checked against what Slurm told this task (``SLURMD_NODENAME``, ``SLURM_LOCALID``, ``SLURM_GTIDS``): a layout
that cannot be derived is one clear error, never a wrong rank. Ports: a block per job step in
``PORT_LOW..PORT_HIGH`` (see :func:`port_base`), one port per task on its node.
"""

import itertools
import logging
import re

from kerasdist import ClusterConfigError, ClusterInfo
from kerasdist.plugin_tools import slurm_step_tasks

log = logging.getLogger("kerasdist.slurm")

PORT_BASE_VAR = "KERASDIST_SLURM_PORT_BASE"
#: Ports derived from the job and step id lie in PORT_LOW..PORT_HIGH-1, below Linux's ephemeral range
#: (32768-60999, where clients' own ports come from); each step gets a block of PORT_BLOCK ports per node.
PORT_LOW, PORT_HIGH, PORT_BLOCK = 20000, 32768, 64
_FIX = ("Run one worker per task with `srun --ntasks N python train.py` and `--distribution=block` (or "
        "cyclic), or give each task a TF_CONFIG naming every worker's host:port.")
_said_single = []


def expand_hostlist(text):
    """Slurm's host list syntax, in the order given: ``"node[9-10],gpu[01-03,7]"`` ->
    ``["node9", "node10", "gpu01", "gpu02", "gpu03", "gpu7"]`` (zero padding kept; several brackets multiply)."""
    hosts = []
    for item in _split_top_level(text.strip(), "SLURM_STEP_NODELIST", text):
        parts = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_range(part[1:-1], text) if part.startswith("[") else [part] for part in parts]
        hosts.extend("".join(combination) for combination in itertools.product(*choices))
    if not hosts or any(not host or "[" in host or "]" in host for host in hosts):
        raise ClusterConfigError(f"Slurm: SLURM_STEP_NODELIST={text!r} is not a host list "
                                 "(expected e.g. node[1-4],gpu07).")
    return hosts


def _split_top_level(text, name, whole):
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ClusterConfigError(f"Slurm: {name}={whole!r} has unbalanced brackets.")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ClusterConfigError(f"Slurm: {name}={whole!r} has unbalanced brackets.")
    return [item for item in items + [current] if item]


def _expand_range(ranges, whole):
    values = []
    for piece in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise ClusterConfigError(f"Slurm: SLURM_STEP_NODELIST={whole!r}: {piece!r} is not a number "
                                     "or a rising range like 01-04.")
        first, last = match.group(1), match.group(2) or match.group(1)
        values.extend(str(n).zfill(len(first)) for n in range(int(first), int(last) + 1))
    return values


def expand_tasks_per_node(text):
    """Slurm's tasks-per-node syntax: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for piece in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", piece)
        if not match or int(match.group(1)) < 1:
            raise ClusterConfigError(f"Slurm: SLURM_STEP_TASKS_PER_NODE={text!r} is not a task count list "
                                     "(expected e.g. 2(x3),1).")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def placement(nodes, tasks_per_node, distribution="block"):
    """``[(node, local id)]`` of every task in rank order, as Slurm places them: ``block`` fills each node in
    turn, ``cyclic`` gives one task to each node with room left, round after round."""
    if distribution == "block":
        return [(node, local) for node, count in zip(nodes, tasks_per_node) for local in range(count)]
    if distribution == "cyclic":
        placed, used = [], [0] * len(nodes)
        while len(placed) < sum(tasks_per_node):
            for i, node in enumerate(nodes):
                if used[i] < tasks_per_node[i]:
                    placed.append((node, used[i]))
                    used[i] += 1
        return placed
    raise ValueError(distribution)


def node_distribution(environ):
    """``block`` or ``cyclic``: how Slurm spread this step's tasks over its nodes (SLURM_DISTRIBUTION's first part)."""
    value = environ.get("SLURM_DISTRIBUTION", "").strip()
    first = re.split(r"[:,=]", value)[0].lower() if value else "block"
    if first in ("block", "cyclic", "*", ""):
        return "cyclic" if first == "cyclic" else "block"
    raise ClusterConfigError(
        f"Slurm: SLURM_DISTRIBUTION={value!r}: kerasdist derives each task's host and port from a block or "
        f"cyclic distribution only (an {first} layout is not in the step's variables). {_FIX}")


def port_base(environ, tasks_on_a_node):
    """The first port of this step on every node: KERASDIST_SLURM_PORT_BASE if set, else a block derived from
    SLURM_JOB_ID and SLURM_STEP_ID, so that jobs and steps sharing a node get different ports."""
    if environ.get(PORT_BASE_VAR, "").strip():
        base = _whole_number(environ[PORT_BASE_VAR], PORT_BASE_VAR)
        if not 1 <= base <= 65536 - tasks_on_a_node:
            raise ClusterConfigError(f"{PORT_BASE_VAR}={base}: the ports {base}..{base + tasks_on_a_node - 1} "
                                     "must lie in 1..65535.")
        return base
    if tasks_on_a_node > PORT_BLOCK:
        raise ClusterConfigError(f"Slurm: {tasks_on_a_node} tasks on one node need more than the {PORT_BLOCK} ports "
                                 f"a step is given; set {PORT_BASE_VAR} to the first of "
                                 f"{tasks_on_a_node} free ports.")
    job = _whole_number(environ.get("SLURM_JOB_ID", "0"), "SLURM_JOB_ID")
    step = _whole_number(environ.get("SLURM_STEP_ID", "0"), "SLURM_STEP_ID")
    blocks = (PORT_HIGH - PORT_LOW) // PORT_BLOCK
    return PORT_LOW + ((job + 37 * step) % blocks) * PORT_BLOCK


def in_task_step(environ):
    """Whether this process is a task of an srun step (not the batch script itself, nor an extern step)."""
    return slurm_step_tasks(environ) > 0


def step_tasks(environ):
    """How many tasks this srun step has (0 outside a step)."""
    return slurm_step_tasks(environ)


def detect(environ):
    """The cluster of an srun step with several tasks; None for one task, or for a batch script outside srun
    (one process, said once)."""
    if not in_task_step(environ):
        if not _said_single:
            _said_single.append(True)
            log.warning("kerasdist: Slurm batch script outside srun (SLURM_PROCID outside an srun step): "
                        "training as one process; start it with `srun python train.py` for one worker per task.")
        return None
    tasks = step_tasks(environ)
    if tasks <= 1:
        return None
    missing = [n for n in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE") if not environ.get(n, "").strip()]
    if missing:
        raise ClusterConfigError(f"Slurm: SLURM_STEP_NUM_TASKS={tasks} but {', '.join(missing)} is not set. {_FIX}")
    nodes = expand_hostlist(environ["SLURM_STEP_NODELIST"])
    counts = expand_tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
    if len(counts) != len(nodes) or sum(counts) != tasks:
        raise ClusterConfigError(
            f"Slurm: SLURM_STEP_NODELIST={environ['SLURM_STEP_NODELIST']!r} ({len(nodes)} nodes) and "
            f"SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']!r} ({sum(counts)} tasks on "
            f"{len(counts)} nodes) do not describe SLURM_STEP_NUM_TASKS={tasks} tasks. {_FIX}")
    layout = placement(nodes, counts, node_distribution(environ))
    rank = _whole_number(environ.get("SLURM_PROCID"), "SLURM_PROCID")
    if not 0 <= rank < tasks:
        raise ClusterConfigError(f"Slurm: SLURM_PROCID={rank} is outside the step's {tasks} tasks. {_FIX}")
    check_own_place(environ, layout, rank)
    base = port_base(environ, max(counts))
    cluster = {"worker": [f"{node}:{base + local}" for node, local in layout]}
    return ClusterInfo(task_type="worker", task_index=rank, cluster=cluster, source="slurm",
                       extra={"port_base": base, "local_rank": layout[rank][1]})


def check_own_place(environ, layout, rank):
    """Raise unless this task's derived node, local id and node-mates are the ones Slurm gave it."""
    node, local = layout[rank]
    told = {"SLURMD_NODENAME": (environ.get("SLURMD_NODENAME"), node),
            "SLURM_LOCALID": (environ.get("SLURM_LOCALID"), str(local)),
            "SLURM_GTIDS": (environ.get("SLURM_GTIDS"),
                            ",".join(str(r) for r, (n, _) in enumerate(layout) if n == node))}
    wrong = [f"{name}={given!r} (derived: {derived!r})" for name, (given, derived) in told.items()
             if given is not None and given.strip() != derived]
    if wrong:
        raise ClusterConfigError(
            f"Slurm: task SLURM_PROCID={rank} is not where the step's variables place it "
            f"({node_distribution(environ)} distribution over SLURM_STEP_NODELIST="
            f"{environ['SLURM_STEP_NODELIST']!r}, SLURM_STEP_TASKS_PER_NODE={environ['SLURM_STEP_TASKS_PER_NODE']!r}): "
            f"{'; '.join(wrong)}. {_FIX}")


def refuse_launch_in_step(environ):
    """``kerasdist launch`` inside a multi-task srun step would start one whole cluster per task."""
    tasks = step_tasks(environ)
    if tasks > 1:
        raise ClusterConfigError(
            f"kerasdist launch: this is one of the {tasks} tasks of an srun step (SLURM_STEP_NUM_TASKS={tasks}): "
            f"each task would start its own cluster of workers, all training the same job. Use `srun --ntasks "
            f"{tasks} python train.py` (no launch: each task is a worker), or `srun --ntasks 1 kerasdist launch "
            "-n N train.py`.")


def _whole_number(value, name):
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        raise ClusterConfigError(f"Slurm: {name}={value!r} is not a whole number.") from None
