"""Training data and long-context evaluation: tokenizers, sources, packing, passkey.

Pure Python and torch (no Ray, no pydantic), so it runs inside any torchrun worker::

    from ringray.data import ByteTokenizer, PackedLoader, evaluate_passkey, make_source

    tokenizer = ByteTokenizer()                     # or HFTokenizer.from_pretrained("ckpt/")
    loader = PackedLoader(make_source("stdlib", None), tokenizer=tokenizer, seq_len=16384,
                          global_batch=8, dp_rank=dp_rank, dp_size=dp_size, seed=0)
    loader.load_state_dict(checkpoint["data"])      # optional: resume (any DP degree)
    inputs, labels = loader.next_batch()            # (8 // dp_size, 16384), global order
    ...
    checkpoint["data"] = loader.state_dict()

    report = evaluate_passkey(predict, tokenizer, lengths=[4096, 16384],
                              depths=[0.0, 0.5, 1.0], samples_per_cell=8, seed=1234)
    print(report.format_table())
"""

from ringray.data.loader import IGNORE_LABEL, LoaderStateMismatch, PackedBatch, PackedLoader
from ringray.data.passkey import (
    MIN_FILLER_TOKENS,
    PASSKEY_DIGIT_CHANCE,
    PASSKEY_DIGITS,
    PASSKEY_FILLER,
    PasskeyCell,
    PasskeyReport,
    PasskeySample,
    evaluate_passkey,
    make_passkey_sample,
    passkey_chance_accuracy,
    passkey_min_seq_len,
    score_answer,
)
from ringray.data.sources import (
    SOURCE_KINDS,
    DataOptions,
    DirectorySource,
    MemorySource,
    PasskeySource,
    StdlibSource,
    TokenSource,
    check_data_path,
    make_source,
)
from ringray.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "LoaderStateMismatch",
    "IGNORE_LABEL",
    "PackedBatch",
    "MIN_FILLER_TOKENS",
    "PASSKEY_DIGIT_CHANCE",
    "PASSKEY_DIGITS",
    "PASSKEY_FILLER",
    "SOURCE_KINDS",
    "ByteTokenizer",
    "HFTokenizer",
    "DataOptions",
    "DirectorySource",
    "MemorySource",
    "PackedLoader",
    "PasskeyCell",
    "PasskeyReport",
    "PasskeySample",
    "PasskeySource",
    "StdlibSource",
    "TokenSource",
    "Tokenizer",
    "check_data_path",
    "evaluate_passkey",
    "make_passkey_sample",
    "make_source",
    "passkey_chance_accuracy",
    "passkey_min_seq_len",
    "score_answer",
]
