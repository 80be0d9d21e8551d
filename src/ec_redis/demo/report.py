"""The demo's report: per request, where PD's embedding came from, PD's encoder passes, time
to first token with and without the cache, and whether PD's output equals the baseline's.

Each engine answers the requests one at a time, so the connector counters that moved during
a request belong to that request's one image.
"""

from __future__ import annotations

import statistics
import textwrap
from typing import Any

TIERS = ("gpu", "cpu", "redis")  # the connector's counters hits_<tier>
# What must match, bit for bit: the prompt as tokens, every prompt position's logprob (and
# its top candidates), and the generated tokens.
COMPARED = ("prompt_token_ids", "prompt_logprobs", "prompt_topk", "token_ids")


def build_report(
    results: dict[str, dict[str, Any]], requests: list[dict[str, Any]]
) -> dict[str, Any]:
    """``results``: the engines' outputs (``encoder``, ``baseline``, ``pd``) by name."""
    rows = []
    for n, request in enumerate(requests):
        encoder = results["encoder"]["requests"][n]
        baseline = results["baseline"]["requests"][n]
        pd = results["pd"]["requests"][n]
        rows.append(
            {
                **request,
                "encoder": {
                    "encoder_passes": encoder["encoder_passes"],
                    "saved_items": _count(encoder, "worker", "saved_items"),
                },
                "pd": {
                    "tier": _tier(pd),
                    "loaded_items": _count(pd, "worker", "loaded_items"),
                    "served_by": _served_by(pd),
                    "encoder_passes": pd["encoder_passes"],
                    "ttft_s": pd["ttft_s"],
                    "token_ids": pd["token_ids"],
                    "text": pd["text"],
                },
                "baseline": {
                    "encoder_passes": baseline["encoder_passes"],
                    "ttft_s": baseline["ttft_s"],
                },
                "identical": all(pd[k] == baseline[k] for k in COMPARED),
                "embedding": _embedding_check(
                    _encoded_for(request, requests, results["encoder"]), baseline, pd
                ),
            }
        )
    return {
        "mode": "engines",
        "requests": rows,
        "all_identical": all(r["identical"] for r in rows),
        "pd_encoder_passes": sum(r["pd"]["encoder_passes"] for r in rows),
        "pd_connector_totals": results["pd"]["connector_totals"],
        "engines": {
            name: {
                "engine_start_s": result["engine_start_s"],
                "total_s": result["total_s"],
                "shutdown_errors": result["shutdown_errors"],
            }
            for name, result in results.items()
        },
    }


def _encoded_for(
    request: dict[str, Any], requests: list[dict[str, Any]], encoder: dict[str, Any]
) -> str | None:
    """The digest of what the encoder engine computed for this request's image: in the first
    request naming the same image (a repeat is not encoded again), or ``None``."""
    for n, other in enumerate(requests):
        same = (other["image_seed"], other.get("uuid")) == (
            request["image_seed"],
            request.get("uuid"),
        )
        produced = encoder["requests"][n]["embeddings"]["produced"]
        if same and produced is not None:
            return str(produced)
    return None


def _embedding_check(
    encoded: str | None, baseline: dict[str, Any], pd: dict[str, Any]
) -> dict[str, Any]:
    """Whether PD's language model was fed the same image embedding bytes as the baseline's
    (``same_as_baseline``) and exactly what the encoder engine computed for this request's
    image (``from_encoder``: what the cache delivered, or vLLM's own copy of it); ``fed``:
    whether both PD's and the baseline's models were seen being fed one; the tokens each
    engine's steps embedded (``steps``: PD's, the baseline's)."""
    fed, baseline_fed = pd["embeddings"]["fed"], baseline["embeddings"]["fed"]
    return {
        "fed": fed is not None and baseline_fed is not None,
        "same_as_baseline": fed is not None and fed == baseline_fed,
        "from_encoder": fed is not None and fed == encoded,
        "encoded": encoded is not None,
        "steps": [pd["embeddings"]["steps"], baseline["embeddings"]["steps"]],
    }


def _count(result: dict[str, Any], side: str, name: str) -> int:
    return int(result["counters"].get(side, {}).get(name, 0))


def _tier(pd: dict[str, Any]) -> str | None:
    """The tier the connector's lookup found the item in during this request, if any."""
    found = [t for t in TIERS if _count(pd, "scheduler", f"hits_{t}")]
    return found[0] if found else None


def _served_by(pd: dict[str, Any]) -> str:
    if _count(pd, "worker", "loaded_items"):
        return f"connector ({_tier(pd) or '?'} tier)"
    if pd["encoder_passes"]:
        return "encoded on PD"
    return "vLLM's own encoder cache"


def render(report: dict[str, Any]) -> list[str]:
    """The report as text: a table, then a summary a newcomer can follow."""
    header = ("#", "request", "encoder engine", "PD got it from", "encodes PD/base",
              "TTFT PD / base", "same output")  # fmt: skip
    table = [header]
    for n, row in enumerate(report["requests"], 1):
        pd, baseline = row["pd"], row["baseline"]
        table.append(
            (
                str(n),
                row["label"],
                _encoder_cell(row["encoder"]),
                _source_cell(pd),
                f"{pd['encoder_passes']} / {baseline['encoder_passes']}",
                f"{_ms(pd['ttft_s'])} / {_ms(baseline['ttft_s'])}",
                "yes" if row["identical"] else "NO",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    summary = [textwrap.fill(paragraph, width=100) for paragraph in _summary(report)]
    return [*lines, "", *summary]


def _encoder_cell(encoder: dict[str, Any]) -> str:
    if encoder["saved_items"]:
        return "encoded, saved"
    return "encoded, not saved" if encoder["encoder_passes"] else "had it already"


def _source_cell(pd: dict[str, Any]) -> str:
    if pd["loaded_items"]:
        return {"redis": "Redis", "cpu": "CPU tier", "gpu": "GPU tier"}.get(pd["tier"], "?")
    if pd["encoder_passes"]:
        return "a miss: encoded"
    return "vLLM's own cache"


def _summary(report: dict[str, Any]) -> list[str]:
    rows = report["requests"]
    loaded = [r for r in rows if r["pd"]["loaded_items"]]
    from_redis = sum(1 for r in loaded if r["pd"]["tier"] == "redis")
    kept = sum(1 for r in rows if not r["pd"]["loaded_items"] and not r["pd"]["encoder_passes"])
    passes = report["pd_encoder_passes"]
    sources = [f"{_n(from_redis, 'embedding')} came from Redis (saved there by the encoder)"]
    if len(loaded) > from_redis:
        sources.append(f"{len(loaded) - from_redis} from its CPU tier")
    if kept:
        sources.append(f"{_n(kept, 'repeat')} from vLLM's own encoder cache")
    lines = [
        f"PD ran its vision encoder {_n(passes, 'time')} for {_n(len(rows), 'image request')}: "
        + ", ".join(sources)
        + "."
    ]
    if report["all_identical"]:
        lines.append(
            "Every PD output (its tokens and the logprob of every prompt position) is "
            "bit-identical to the baseline engine's, which encoded the images itself."
        )
    else:
        bad = ", ".join(str(n) for n, r in enumerate(rows, 1) if not r["identical"])
        lines.append(f"PROBLEM: PD's output differs from the baseline's for request(s) {bad}.")
        lines += [_why(n, r) for n, r in enumerate(rows, 1) if not r["identical"]]
    lines += _ttft_lines(report)
    lines.append(f"Done in {report['wall_s']:.0f} s. Logs and the model: {report['run_dir']}")
    return lines


def _why(n: int, row: dict[str, Any]) -> str:
    """What the image embeddings say about a request whose output differs."""
    check = row["embedding"]
    if not check["fed"]:
        return (
            f"Request {n}: no image embedding was seen entering PD's or the baseline's model: "
            "no diagnosis."
        )
    if check["same_as_baseline"]:
        pd_steps, base_steps = check["steps"]
        split = (
            f" vLLM split the work differently (tokens per step: PD {pd_steps}, baseline "
            f"{base_steps}), and its kernels promise the same bits only for the same split."
            if pd_steps != base_steps
            else f" Both ran the same steps (tokens per step: {pd_steps})."
        )
        return (
            f"Request {n}: PD's language model was fed the baseline's image embedding bit for "
            "bit, so the difference arose in the engines' own arithmetic after it, not in "
            "what the cache delivered." + split
        )
    if check["from_encoder"]:
        return (
            f"Request {n}: PD was fed exactly the embedding the encoder engine computed, which "
            "differs from the one the baseline computed itself: the two engines' vision "
            "towers did not compute the same bits."
        )
    if not check["encoded"]:
        return (
            f"Request {n}: PD was fed other bytes than the baseline, and the encoder engine "
            "computed nothing for this image to compare them with: no diagnosis."
        )
    return (
        f"Request {n}: PD's language model was fed other bytes than the encoder engine "
        "computed for this image: the cache delivered a wrong tensor."
    )


def _ttft_lines(report: dict[str, Any]) -> list[str]:
    """Time to first token where it tells: the requests whose embedding PD loaded from Redis
    (new images: the baseline ran its vision tower for them), or every request if none."""
    rows = list(enumerate(report["requests"], 1))
    fresh = [(n, r) for n, r in rows if r["pd"]["tier"] == "redis"]
    pairs = [
        (r["pd"]["ttft_s"], r["baseline"]["ttft_s"])
        for _, r in fresh or rows
        if r["pd"]["ttft_s"] is not None and r["baseline"]["ttft_s"] is not None
    ]
    if not pairs:
        return []
    pd_s = statistics.median(p for p, _ in pairs)
    base_s = statistics.median(b for _, b in pairs)
    if fresh:
        numbers = ", ".join(str(n) for n, _ in fresh)
        which = f"for the images PD took from Redis (request{'s' * (len(fresh) > 1)} {numbers})"
    else:
        which = "over all requests"
    line = (
        f"Time to first token {which}, median: PD {_ms(pd_s)} with the cache, baseline "
        f"{_ms(base_s)} running its vision tower itself"
    )
    if pd_s < base_s:
        line += f": {_ms(base_s - pd_s)} saved per image."
    else:
        line += "; PD was not faster this time (on a busy machine these times vary)."
    sizing = report.get("model_sizing")
    return [line, f"Model: {sizing}."] if sizing else [line]


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
