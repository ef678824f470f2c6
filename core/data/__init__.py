"""Data for post-training: sources -> validated rows -> tokenized documents -> packed batches.

    sources.py   local JSONL (streamed, errors by line), Parquet, datasets save_to_disk directories
    formats.py   TRL's row formats (messages, prompt/completion, preference, implicit preference),
                 detected from the columns, every row validated field by field
    encode.py    chat-template tokenization, loss labels, truncation policy
    split.py     train/validation/test by a hash of each row's content
    packing.py   packing into max_seq_len rows, padding-free and padded collation, cu_seqlens
    sampler.py   deterministic, resumable, rank-sharded micro-batches
    dataset.py   load_data(cfg, tokenizer) and build_loader(...): what stages call; load_rows (validated,
                 untokenized rows for data prep) and load_documents (one split's files, tokenized)

Bad rows raise DataError naming file, row and field, or are counted in DropStats when
on_bad_row="skip".
"""

from core.data.dataset import PreparedData, build_loader, for_each_example, load_data, load_documents, load_rows
from core.data.encode import Document, Encoder, PreferencePair
from core.data.errors import REASONS, DataError, DropStats
from core.data.formats import FORMATS, detect_format, validate_row
from core.data.packing import collate_padded, collate_padding_free, collate_preference, pack, sequence_sums
from core.data.sampler import BatchSampler, StatefulLoader
from core.data.sources import open_sources
from core.data.split import assign_split, content_hash, split_key

__all__ = [
    "FORMATS", "REASONS", "BatchSampler", "DataError", "Document", "DropStats", "Encoder", "PreferencePair",
    "PreparedData", "StatefulLoader", "assign_split", "build_loader", "collate_padded", "collate_padding_free",
    "collate_preference", "content_hash", "detect_format", "for_each_example", "load_data", "load_documents",
    "load_rows", "open_sources", "pack", "sequence_sums", "split_key", "validate_row",
]
