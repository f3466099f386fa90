"""An evaluation harness through the API: EleutherAI lm-eval's `local-completions` model scores a small
multiple-choice task (tests/fixtures/serve_mc.jsonl) against a real server on 127.0.0.1, and gets the same
per-choice log-likelihoods and the same accuracy as scoring the task directly with our model.

lm-eval is heavy (datasets, pandas, scikit-learn...): it is the optional extra `eval`
(pip install 'nanoeuler[eval]', i.e. lm-eval[api]); without it this file is skipped."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import ServerThread, shared_checkpoint  # noqa: E402

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'nanoeuler[eval]', i.e. lm-eval[api])")
DATA = Path(__file__).parent / "fixtures" / "serve_mc.jsonl"

TASK = """task: nanoeuler_serve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def direct_scores(model, tok, context: str, choice: str) -> float:
    """log p(" " + choice | context), split into tokens as lm-eval does (its _encode_pair)."""
    cont = " " + choice
    ctx_ids = tok.encode(context)
    whole = tok.encode(context + cont)
    ids = np.array([whole])
    logits = model.logits(ids)[0, 0].astype(np.float64)  # [T, V]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    return float(sum(logp[i - 1, whole[i]] for i in range(len(ctx_ids), len(whole))))


def test_lm_eval_local_completions_equals_direct_scoring(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from nanoeuler.serve.app import create_app
    d, model, tok = shared_checkpoint()
    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    direct = [[direct_scores(model, tok, doc["context"], c) for c in doc["choices"]] for doc in docs]
    direct_acc = float(np.mean([int(np.argmax(s)) == doc["answer"] for s, doc in zip(direct, docs)]))

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "serve_mc.yaml").write_text(TASK.format(data=DATA))
    app = create_app(model, tok, "tiny", max_batch=8)
    with ServerThread(app) as srv:
        out = simple_evaluate(model="local-completions",
                              model_args=f"base_url={srv.url}/v1/completions,model=tiny,num_concurrent=1,"
                                         f"max_retries=1,tokenizer_backend=remote",
                              tasks=["nanoeuler_serve_mc"], task_manager=TaskManager(include_path=str(tasks)),
                              log_samples=True, limit=None)
    acc = out["results"]["nanoeuler_serve_mc"]["acc,none"]
    print(f"lm-eval accuracy {acc:.4f}, direct {direct_acc:.4f} ({len(docs)} questions)")
    assert acc == pytest.approx(direct_acc)
    samples = sorted(out["samples"]["nanoeuler_serve_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    for s, want in zip(samples, direct):
        got = [r[0] for r in s["filtered_resps"]]
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert 0 < direct_acc  # the model knows some Hamlet: the comparison is not all-wrong vs all-wrong
