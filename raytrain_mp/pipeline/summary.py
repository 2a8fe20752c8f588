"""The pipeline's summary as a person reads it (``raytrain-mp pipeline`` without ``--json``).

The result (``run.run_pipeline``'s, and ``result.json``'s) lists every stage's blocks and the full
node id of every actor: 141 block names and 64-hex ids for a MobileNet make one line of thousands of
characters. ``text_summary`` gives each stage one short line and each replica one, and leaves the
detail to ``--json``. Invariant: a pure function of the result; every other field passes unchanged.
"""

from __future__ import annotations


def text_summary(result: dict) -> dict:
    """The summary as a person reads it (without ``--json``): ``stages`` and ``actors`` become one
    short line per stage (``stage 0``: first and last block, block and parameter counts, the node
    where there is one replica) and per replica (its stages' nodes); block lists and full node ids
    stay in the JSON line (and ``result.json``)."""
    stages, actors = result.get("stages") or [], result.get("actors") or []
    brief = {key: value for key, value in result.items() if key not in ("stages", "actors")}
    replicas = {actor["replica"] for actor in actors}
    for stage in stages:
        on = f" on node {stage['node_id'][:8]}" if len(replicas) <= 1 and stage.get("node_id") else ""
        blocks = stage["blocks"]
        span = blocks[0] if len(blocks) == 1 else f"{blocks[0]} ... {blocks[-1]}"
        size = f"{len(blocks)} block{'s' * (len(blocks) != 1)}, {count(stage['params'])} params"
        brief[f"stage {stage['index']}"] = f"{span} ({size}){on}"
    if len(replicas) > 1:
        for replica in sorted(replicas):
            nodes = [actor["node_id"] for actor in actors if actor["replica"] == replica]
            brief[f"replica {replica}"] = stages_on_nodes(nodes)
    return brief


def count(number: int) -> str:
    """``1.2M``, ``35.3k``, ``812``."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if number >= scale:
            return f"{number / scale:.3g}{suffix}"
    return str(number)


def stages_on_nodes(nodes: list[str]) -> str:
    """``stages 0-1 on node 5f35ab12, stage 2 on node 9a0c1d2e``: consecutive stages on one node together."""
    runs: list[list] = []
    for stage, node in enumerate(nodes):
        if runs and runs[-1][2] == node:
            runs[-1][1] = stage
        else:
            runs.append([stage, stage, node])
    return ", ".join(
        (f"stage {first}" if first == last else f"stages {first}-{last}") + f" on node {node[:8]}"
        for first, last, node in runs
    )
