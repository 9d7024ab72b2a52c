"""Pure token and record accounting for the chaos harness (no processes, no I/O).

A stream is compared with its reference token for token. The unit is the stream's UTF-8 bytes,
which are baton-tiny's token ids (ByteTokenizer: ids 0..255 are bytes); a reference id the
tokenizer renders as U+FFFD renders the same way in both, so the comparison stays exact."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TokenCount:
    reference: int  # tokens the reference has
    received: int  # tokens the client got
    matched: int  # longest common subsequence of the two
    lost: int  # reference tokens missing from the stream
    duplicated: int  # extra stream tokens that repeat a stretch already delivered
    wrong: int  # extra stream tokens that are neither in order nor a repeat
    exact: bool  # stream == reference

    def as_dict(self) -> dict:
        return asdict(self)


def _lcs_alignment(ref: list[int], got: list[int]) -> list[tuple[int, int]]:
    """Pairs (i, j) with ref[i] == got[j] of one longest common subsequence, in order."""
    n, m = len(ref), len(got)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        row, below = table[i], table[i + 1]
        for j in range(m - 1, -1, -1):
            row[j] = below[j + 1] + 1 if ref[i] == got[j] else max(below[j], row[j + 1])
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if ref[i] == got[j]:
            pairs.append((i, j))
            i += 1
            j += 1
        elif table[i + 1][j] >= table[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def count_tokens(reference: list[int], received: list[int]) -> TokenCount:
    """Lost = reference tokens the stream lacks; an extra run of stream tokens (not in the
    alignment) is duplicated when it re-sends a stretch of the reference that the stream had
    already delivered before it (what a resend from a stale offset does), wrong otherwise."""
    ref, got = list(reference), list(received)
    if ref == got:
        return TokenCount(len(ref), len(got), len(ref), 0, 0, 0, True)
    pairs = _lcs_alignment(ref, got)
    matched_j = {j for _, j in pairs}
    # For each stream position, how many reference tokens were delivered before it.
    delivered_before = []
    k, done = 0, 0
    for j in range(len(got)):
        delivered_before.append(done)
        if k < len(pairs) and pairs[k][1] == j:
            done = pairs[k][0] + 1
            k += 1
    duplicated = wrong = 0
    j = 0
    while j < len(got):
        if j in matched_j:
            j += 1
            continue
        start = j
        while j < len(got) and j not in matched_j:
            j += 1
        run = got[start:j]
        head = ref[: delivered_before[start]]
        if _contains(head, run):
            duplicated += len(run)
        else:
            # The longest prefix of the run that repeats delivered tokens counts as duplicated.
            best = 0
            for cut in range(len(run) - 1, 0, -1):
                if _contains(head, run[:cut]):
                    best = cut
                    break
            duplicated += best
            wrong += len(run) - best
    return TokenCount(
        reference=len(ref),
        received=len(got),
        matched=len(pairs),
        lost=len(ref) - len(pairs),
        duplicated=duplicated,
        wrong=wrong,
        exact=False,
    )


def _contains(seq: list[int], run: list[int]) -> bool:
    if not run:
        return True
    n = len(run)
    return any(seq[i : i + n] == run for i in range(len(seq) - n + 1))


def max_gap(times: list[float]) -> float | None:
    """Largest gap between consecutive arrivals (seconds), None with fewer than two."""
    if len(times) < 2:
        return None
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def record_counts(request_ids: list[str | None], records_per_id: dict[str, int]) -> dict:
    """Missing: requests with no record (or whose id the client never learnt); double: more
    than one record for one id."""
    missing = sum(1 for rid in request_ids if not rid or records_per_id.get(rid, 0) == 0)
    double = sum(1 for rid in request_ids if rid and records_per_id.get(rid, 0) > 1)
    return {"missing_records": missing, "double_records": double}


COLUMNS = (
    "trials",
    "finished_correct",
    "lost_tokens",
    "duplicated_tokens",
    "wrong_tokens",
    "errors",
    "missing_records",
    "double_records",
)


def summarise_fault(trials: list[dict]) -> dict:
    """One fault's row from its trials (each trial: a list of request results plus its
    recovery seconds). Requests are what is counted; trials are repetitions of the fault."""
    out = {c: 0 for c in COLUMNS}
    out["trials"] = len(trials)
    out["requests"] = 0
    recov, gaps, stalls, migrations = [], [], [], 0
    for trial in trials:
        for r in trial.get("requests", []):
            out["requests"] += 1
            out["finished_correct"] += int(bool(r.get("correct")))
            tc = r.get("tokens") or {}
            out["lost_tokens"] += int(tc.get("lost", 0))
            out["duplicated_tokens"] += int(tc.get("duplicated", 0))
            out["wrong_tokens"] += int(tc.get("wrong", 0))
            out["errors"] += int(bool(r.get("error")))
            migrations += int((r.get("record") or {}).get("migrations") or 0)
            if r.get("max_gap_s") is not None:
                gaps.append(float(r["max_gap_s"]))
            if r.get("stall_s") is not None:
                stalls.append(float(r["stall_s"]))
        out["missing_records"] += int(trial.get("missing_records", 0))
        out["double_records"] += int(trial.get("double_records", 0))
        if trial.get("recovery_s") is not None:
            recov.append(float(trial["recovery_s"]))
    out["migrations"] = migrations
    out["recovery_s"] = _spread(recov)
    out["max_gap_s"] = _spread(gaps)
    if stalls:
        out["stall_s"] = _spread(stalls)
    return out


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    v = sorted(values)
    return {"min": round(v[0], 3), "median": round(v[len(v) // 2], 3), "max": round(v[-1], 3)}
