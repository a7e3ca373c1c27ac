"""`--draft mtp` measured (`python -m benchmarks.draft_speedup --draft mtp`): a synthetic
DeepSeek-V3 with an MTP module on local workers, plainly, with a random module (within 5%) and
with one right by construction beside a one-layer draft model made as right."""

from __future__ import annotations

import time
from pathlib import Path

from mlx_lm.utils import load

from benchmarks.draft_rows import figures, log, median_run, result_lines
from benchmarks.records import machine
from builders.demo_models import build_once, cache_root
from builders.synthetic import build_bigram_draft, build_checkpoint
from coordinator.cli.demo_command import demo_workers
from coordinator.decoding.draft_policy import DraftPolicy
from coordinator.decoding.generate import generate
from coordinator.decoding.mtp_draft import mtp_draft
from coordinator.decoding.speculative import Draft
from engine.sharding import shard

PROMPT = list(range(5, 37))  # token ids: the synthetic tokenizer's text means nothing
USELESS_TOLERANCE = 0.05  # a useless module may cost at most this share of plain decode speed
# The MTP module's speed-up, at least this share of the draft model's at the same acceptance.
SAME_SPEEDUP_SHARE = 0.9


def prepared(size: str, dtype: str, workers: int) -> dict[str, tuple[Path, Path | None]]:
    """name -> (its split for `workers`, the draft model as right as its module, if any),
    built into the cache ($SHOAL_CACHE, else ~/.cache/shoal) on first use."""
    root = cache_root() / "mtp-bench"
    out = {}
    for name, module in (("random", "random"), ("right", "bigram")):
        source = build_once(
            root / f"{name}-{size}-{dtype}",
            lambda path, module=module: build_checkpoint(
                path, "deepseek_v3", size=size, dtype=dtype, seed=1, mtp=module),
            f"a {size} deepseek_v3 with a {name} MTP module")
        sharded = build_once(root / f"{name}-{size}-{dtype}-w{workers}",
                             lambda path, source=source: shard(source, path, workers=workers,
                                                               progress=False),
                             f"its split for {workers} workers")
        draft = build_once(root / f"{name}-{size}-{dtype}-draft",
                           lambda path, source=source: build_bigram_draft(path, source),
                           "a draft model as right as its module") if module == "bigram" else None
        out[name] = (sharded, draft)
    return out


def run(*, runs: int, tokens: int, max_draft: int, workers: int, size: str = "bench",
        dtype: str = "float32") -> dict:
    """Plain and drafted decoding of each model, interleaved run by run."""
    started = time.perf_counter()
    adaptive, fixed = DraftPolicy(max_draft), DraftPolicy(max_draft, adaptive=False)
    report = {}
    for name, (sharded, draft_dir) in prepared(size, dtype, workers).items():
        with demo_workers(sharded, workers) as (remote, _):
            drafts = {"mtp_adaptive": mtp_draft(remote.model, adaptive),
                      "mtp_fixed": mtp_draft(remote.model, fixed)}
            if draft_dir is not None:
                model = load(str(draft_dir))[0]
                drafts["model_adaptive"] = Draft(model, adaptive, draft_dir)
                drafts["model_fixed"] = Draft(model, fixed, draft_dir)
            log(f"{name} module: warming up")
            generate(remote.model, remote.tokenizer, PROMPT, max_tokens=4)
            samples: dict[str, list[dict]] = {key: [] for key in ["plain", *drafts]}
            for index in range(runs):
                log(f"{name} module, run {index + 1} of {runs}")
                plain = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=tokens)
                samples["plain"].append(figures(plain, None))
                for key, draft in drafts.items():
                    result = generate(remote.model, remote.tokenizer, PROMPT,
                                      max_tokens=tokens, draft=draft)
                    samples[key].append(figures(result, plain))
        rows = {f"{name}_{key}": median_run(found) for key, found in samples.items()}
        base = rows[f"{name}_plain"]["decode_tps"]
        for row in rows.values():
            row["ratio_vs_plain"] = row["decode_tps"] / base if base else None
        report.update(rows)
    useless = report["random_mtp_adaptive"]["ratio_vs_plain"]
    shares = {}
    for policy in ("adaptive", "fixed"):
        mtp, model = (report[f"right_{key}_{policy}"]["ratio_vs_plain"]
                      for key in ("mtp", "model"))
        shares[policy] = mtp / model if mtp and model else None
    share = shares["adaptive"]  # the depth users get; both at the same acceptance
    targets = {
        "useless_module_within_5pct": useless is not None and useless >= 1 - USELESS_TOLERANCE,
        "mtp_speedup_at_least_90pct_of_draft_model": share is not None and
            share >= SAME_SPEEDUP_SHARE,
        "greedy_tokens_identical": all(row["same_tokens"] for row in report.values()
                                       if "same_tokens" in row),
    }
    return {
        "machine": machine(),
        "settings": {"model": f"synthetic deepseek_v3 ({size}, {dtype}) with an MTP module",
                     "workers": workers, "prompt": f"{len(PROMPT)} token ids",
                     "tokens": tokens, "runs": runs, "num_draft_tokens": max_draft},
        "results": report,
        "ratios": {f"mtp_speedup_over_draft_model_speedup_{policy}": value
                   for policy, value in shares.items()},
        "targets": targets,
        "seconds": time.perf_counter() - started,
    }


def table(report: dict) -> str:
    lines = result_lines("--draft mtp", report, "run", 22)
    for policy in ("adaptive", "fixed"):
        share = report["ratios"][f"mtp_speedup_over_draft_model_speedup_{policy}"]
        if share is not None:
            lines.append(f"  the MTP module's speed-up is {share:.2f}x the draft model's "
                         f"({policy}, same acceptance)")
    for name, met in report["targets"].items():
        lines.append(f"  target {name}: {'met' if met else 'MISSED'}")
    return "\n".join(lines)
