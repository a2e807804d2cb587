"""The golden inputs of the fixture generators: the first N tokens of a jsonl text, documents
joined with the end-of-sequence token, as statecut's evaluation protocol joins them."""

import json


def first_tokens(tokenizer_path, data_path, eos, n):
    """[1, n] token ids (torch int64) of the first documents of `data_path`."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    ids = []
    with open(data_path) as f:
        for line in f:
            if line.strip():
                ids += tok.encode(json.loads(line)["text"], add_special_tokens=False).ids + [eos]
            if len(ids) >= n:
                break
    return torch.tensor([ids[:n]])
