"""Data for post-training: sources -> validated rows -> tokenized documents -> packed batches.

    sources.py   local JSONL (streamed, errors by line), Parquet, datasets save_to_disk directories
    formats.py   TRL's row formats (messages, prompt/completion, preference, implicit preference),
                 detected from the columns, every row validated field by field
    encode.py    chat-template tokenization, loss labels, truncation policy
    split.py     train/validation/test by a hash of each row's normalized content
    dataset.py   ExamplePipeline (dedup -> encode -> min length -> split), shared by load_data(cfg,
                 tokenizer) and data prep; load_rows (validated, untokenized rows)
    prepared.py  data prep's Parquet + manifest, read back with the labels data prep computed
                 (read_documents, read_pairs; load_documents / load_pairs also take raw sources)
    packing.py   packing into max_seq_len rows, padding-free and padded collation, cu_seqlens
    sampler.py   deterministic, resumable, rank-sharded micro-batches
    loader.py    build_loader: the one loader the stages use (packing, micro_batch_size / batch_tokens,
                 train vs evaluation, lockstep padding, doc_indices)

Split names are "train", "validation", "test" everywhere. Bad rows raise DataError naming file,
row and field, or are counted in DropStats when on_bad_row="skip".
"""

from core.data.dataset import ExamplePipeline, PreparedData, for_each_example, load_data, load_rows, make_encoder
from core.data.encode import Document, Encoder, PreferencePair, num_tokens
from core.data.errors import REASONS, DataError, DropStats
from core.data.formats import FORMATS, common_prefix, detect_format, validate_row
from core.data.loader import Loader, build_loader
from core.data.packing import collate_padded, collate_padding_free, collate_preference, pack, sequence_sums
from core.data.prepared import (load_documents, load_pairs, output_key, prepared_files, read_documents, read_pairs,
                                read_rows, record)
from core.data.sampler import BatchSampler, StatefulLoader
from core.data.sources import open_sources
from core.data.split import SPLITS, assign_split, canonical_split, content_hash, split_key

__all__ = [
    "FORMATS", "REASONS", "SPLITS", "BatchSampler", "DataError", "Document", "DropStats", "Encoder",
    "ExamplePipeline", "Loader", "PreferencePair", "PreparedData", "StatefulLoader", "assign_split", "build_loader",
    "canonical_split", "collate_padded", "collate_padding_free", "collate_preference", "common_prefix",
    "content_hash", "detect_format", "for_each_example", "load_data", "load_documents", "load_pairs", "load_rows",
    "make_encoder", "num_tokens", "open_sources", "output_key", "pack", "prepared_files", "read_documents",
    "read_pairs", "read_rows", "record", "sequence_sums", "split_key", "validate_row",
]
