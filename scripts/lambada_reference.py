#!/usr/bin/env python3
"""lm-eval-harness's own LAMBADA scores of the reference models, for `tests/lambada.rs`.

Writes tests/fixtures/lambada/docs.jsonl (the first sentence of each of the first documents of
shared/data/eval/wiki.jsonl, then texts that test the split: a trailing newline, two spaces before
the last word, a newline before the last space, a trailing space) and runs lm-eval on it with a
task that is `lambada_openai` (its doc_to_text, doc_to_target, output type and metrics) reading
that file. Models through transformers' own classes, float32 on the CPU, one document per batch.

Written to tests/fixtures/lambada/lm_eval.json: per model, `acc`, `perplexity`, and per document
`loglik` and `is_greedy` (lm-eval's `resps`), with lm-eval's and transformers' versions.

    pip install lm-eval==0.4.13 accelerate
    python3 scripts/lambada_reference.py --shared ../shared
"""

import argparse
import json
import os
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "lambada")
MODELS = ["mamba2", "qwen3_5"]
SENTENCES = 20
EDGE_CASES = [
    "The ship sailed into the harbour at dawn\n",
    "He looked at the sea  again",
    "The whale rose\n slowly",
    "The captain shouted ",
]

# lambada_openai.yaml with the data read from a local file.
TASK = """task: lambada_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_docs(shared, path):
    texts = []
    with open(os.path.join(shared, "data", "eval", "wiki.jsonl")) as f:
        for line in f:
            first = json.loads(line)["text"].split(". ")[0]
            texts.append(first if first.endswith(".") else first + ".")
            if len(texts) == SENTENCES:
                break
    texts += EDGE_CASES
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return len(texts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(ROOT, "..", "shared"))
    args = ap.parse_args()
    import lm_eval
    import transformers
    from lm_eval.tasks import TaskManager

    os.makedirs(OUT, exist_ok=True)
    data = os.path.join(OUT, "docs.jsonl")
    n = write_docs(args.shared, data)
    out = {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as tasks:
        with open(os.path.join(tasks, "lambada_local.yaml"), "w") as f:
            f.write(TASK.format(data=data))
        for name in MODELS:
            r = lm_eval.simple_evaluate(
                model="hf",
                model_args=f"pretrained={os.path.join(args.shared, 'models', name)},dtype=float32",
                tasks=["lambada_local"],
                task_manager=TaskManager(include_path=tasks),
                device="cpu",
                batch_size=1,
                log_samples=True,
            )
            samples = sorted(r["samples"]["lambada_local"], key=lambda s: s["doc_id"])
            assert len(samples) == n
            metrics = r["results"]["lambada_local"]
            out["models"][name] = {
                "acc": metrics["acc,none"],
                "perplexity": metrics["perplexity,none"],
                "loglik": [float(s["resps"][0][0][0]) for s in samples],
                "is_greedy": [bool(s["resps"][0][0][1]) for s in samples],
            }
            print(name, metrics["acc,none"], metrics["perplexity,none"])
    with open(os.path.join(OUT, "lm_eval.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
