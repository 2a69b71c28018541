"""The outside judge's own numbers for a case, in a form the suite recomputes in-process.

scripts/verify_paddleformers.py and scripts/verify_hf_export.py run PaddleFormers / transformers in their own venvs,
which the suite cannot import. For every export case (our seeded weights and fixed token ids, which the suite can
rebuild) they record the judge's loss and a digest of its fp32 logits: their mean, their root mean square and their
values at DIGEST_POSITIONS fixed flat positions. The tests rebuild our model from the same seed, compute the same
numbers and compare them with the judge's within 1e-5, so a drift of our model code after the report was written
fails the suite. Each digest value differs between two logit arrays by at most their max |difference| (mean: the
mean difference; rms: |rms(a) - rms(b)| <= rms(a - b)), so the report's 1e-5 bar on the logits carries over.
"""

from __future__ import annotations

import numpy as np

DIGEST_POSITIONS = 8
DIGEST_HEADER = ("| case | judge's loss | judge's logits mean | judge's logits rms | "
                 f"judge's logits at {DIGEST_POSITIONS} flat positions |")


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean cross entropy over labels != -100, in float64 (for a judge that gives logits only)."""
    logits = logits.astype("float64").reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    keep = labels != -100
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return float(-log_probs[keep, labels[keep]].mean())


def digest(logits: np.ndarray, loss: float) -> dict:
    flat = np.asarray(logits, dtype="float64").ravel()
    at = np.linspace(0, flat.size - 1, DIGEST_POSITIONS).round().astype(int)
    return {"loss": float(loss), "mean": float(flat.mean()), "rms": float(np.sqrt((flat ** 2).mean())),
            "at": [float(v) for v in flat[at]]}


def digest_row(case: str, d: dict) -> str:
    return (f"| {case} | {d['loss']:.7f} | {d['mean']:.7f} | {d['rms']:.7f} | "
            + " ".join(f"{v:.7f}" for v in d["at"]) + " |")


def parse_digest_row(line: str) -> tuple[str, dict] | None:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 5:
        return None
    try:
        at = [float(v) for v in cells[4].split()]
        d = {"loss": float(cells[1]), "mean": float(cells[2]), "rms": float(cells[3]), "at": at}
    except ValueError:
        return None
    return (cells[0], d) if len(at) == DIGEST_POSITIONS else None


def differences(ours: dict, judge: dict) -> dict:
    """Largest |ours - judge| per digest field."""
    return {"loss": abs(ours["loss"] - judge["loss"]), "mean": abs(ours["mean"] - judge["mean"]),
            "rms": abs(ours["rms"] - judge["rms"]),
            "at": max(abs(a - b) for a, b in zip(ours["at"], judge["at"]))}
