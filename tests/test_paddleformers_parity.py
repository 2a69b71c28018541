"""Qwen3, Qwen3-MoE, ERNIE 4.5 and DeepSeek-V3 compute PaddleFormers' function: what the suite checks of the
verification report.

PaddleFormers 0.4.1 cannot share an environment with PaddleNLP 2.8.1 (the test requirements' reference), so
`python scripts/verify_paddleformers.py` runs it in its own venv and writes benchmarks/paddleformers_parity.md:
our export loaded by PaddleFormers and a model PaddleFormers saves imported by us, logits and loss in fp32.
The first test checks that the report covers every case of the script, both directions, by PaddleFormers 0.4.1,
each within 1e-5; rerun the script when the families or the cases change.

The second makes the report bite on our code as it is now: for every *export* case (our seeded random weights,
the script's fixed token ids) the report records PaddleFormers' own loss and a digest of its logits (mean, root
mean square, values at fixed flat positions; DeepSeek-V3: main and MTP logits stacked, loss main + 0.3 x MTP).
The test rebuilds our model in-process exactly as the script does (verify_paddleformers.cases and
build_export_model), recomputes those numbers with the script's our_outputs and asserts each within 1e-5 of
PaddleFormers'. A change to our decoder since the report was written fails here. The *import* rows are not
recomputed: PaddleFormers' own saved weights are not in the repository.
"""

from __future__ import annotations

import re
import sys

from launch_utils import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from judge_digest import differences, digest, parse_digest_row  # noqa: E402
from verify_paddleformers import (CASES, DIGEST_SECTION, TOLERANCE, build_export_model, cases,  # noqa: E402
                                  our_outputs)

REPORT = REPO_ROOT / "benchmarks" / "paddleformers_parity.md"
ROW = re.compile(r"^\| (?P<case>[\w-]+) \| (?P<direction>export|import) \| .* \| paddleformers (?P<version>[\d.]+) "
                 r"\((?P<cls>\w+)\), paddle [\d.]+ \| (?P<loss>[\d.]+) \| (?P<logits>[\d.e+-]+) \| "
                 r"(?P<loss_diff>[\d.e+-]+) \| (?P<std>[\d.]+) \| (?P<ok>yes|NO) \|$")


def test_every_case_matches_paddleformers_both_ways():
    rows = [m.groupdict() for m in map(ROW.match, REPORT.read_text().splitlines()) if m]
    seen = {(r["case"], r["direction"]) for r in rows}
    assert seen == {(case, d) for case, _, _ in CASES for d in ("export", "import")}, seen
    for r in rows:
        assert r["version"] == "0.4.1" and r["ok"] == "yes", r
        assert float(r["logits"]) <= TOLERANCE and float(r["loss_diff"]) <= TOLERANCE, r
        assert float(r["std"]) > 0.3, r  # logits far from constant: the comparison means something
        assert r["cls"] == CLASSES[r["case"].split("-")[0]], r


CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
           "ernie4_5_moe": "Ernie4_5_MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def test_our_model_now_gives_paddleformers_recorded_numbers():
    text = REPORT.read_text()
    assert DIGEST_SECTION in text, "rerun python scripts/verify_paddleformers.py"
    judged = dict(filter(None, map(parse_digest_row, text.split(DIGEST_SECTION)[1].split("Notes:")[0].splitlines())))
    assert set(judged) == {case for case, _, _ in CASES}, judged.keys()
    for seed, case, _, _, config, input_ids, labels in cases():
        logits, loss = our_outputs(build_export_model(config, seed), input_ids, labels)
        ours = digest(logits, loss)
        assert max(differences(ours, judged[case]).values()) <= TOLERANCE, (case, ours, judged[case])
