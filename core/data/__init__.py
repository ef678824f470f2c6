"""Data for post-training: sources -> validated rows -> tokenized documents -> packed batches.

    sources.py   local JSONL (streamed, errors by line), Parquet, datasets save_to_disk directories
    formats.py   TRL's row formats (messages, prompt/completion, preference, implicit preference),
                 detected from the columns, every row validated field by field
    encode.py    chat-template tokenization, loss labels, truncation policy
    split.py     train/validation/test by a hash of each row's normalized content
    dataset.py   ExamplePipeline (dedup -> encode -> min length -> split), shared by load_data(cfg,
                 tokenizer) and data prep
    prepared.py  data prep's Parquet + manifest, read back with the labels data prep computed
                 (read_documents, read_pairs; load_documents / load_pairs / load_splits also take raw
                 sources)
    packing.py   packing into max_seq_len rows, padding-free and padded collation, cu_seqlens
    routing.py   several adapters trained at once: which adapter each row trains (a column, or its source)
    sampler.py   deterministic, resumable, rank-sharded micro-batches
    loader.py    build_loader: the one loader the stages use (packing, micro_batch_size / batch_tokens,
                 train vs evaluation, lockstep padding, doc_indices)

Split names are "train", "validation", "test" everywhere. Bad rows raise DataError naming file,
row and field, or are counted in DropStats when on_bad_row="skip".

Names load on first use (core.lazy): `core.data.config` (DataConfig) imports without torch.
"""

from core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "AdapterRouting": "core.data.routing",
    "BatchSampler": "core.data.sampler",
    "DataError": "core.data.errors",
    "Document": "core.data.encode",
    "DropStats": "core.data.errors",
    "Encoder": "core.data.encode",
    "ExamplePipeline": "core.data.dataset",
    "FORMATS": "core.data.formats",
    "Loader": "core.data.loader",
    "PreferencePair": "core.data.encode",
    "PreparedData": "core.data.dataset",
    "REASONS": "core.data.errors",
    "SPLITS": "core.data.split",
    "StatefulLoader": "core.data.sampler",
    "assign_split": "core.data.split",
    "build_loader": "core.data.loader",
    "canonical_split": "core.data.split",
    "collate_padded": "core.data.packing",
    "collate_padding_free": "core.data.packing",
    "collate_preference": "core.data.packing",
    "common_prefix": "core.data.formats",
    "content_hash": "core.data.split",
    "detect_format": "core.data.formats",
    "fit_pair": "core.data.prepared",
    "for_each_example": "core.data.dataset",
    "load_data": "core.data.dataset",
    "load_documents": "core.data.prepared",
    "load_pairs": "core.data.prepared",
    "load_splits": "core.data.prepared",
    "make_encoder": "core.data.dataset",
    "num_tokens": "core.data.encode",
    "open_sources": "core.data.sources",
    "output_key": "core.data.prepared",
    "pack": "core.data.packing",
    "prepared_files": "core.data.prepared",
    "read_documents": "core.data.prepared",
    "read_pairs": "core.data.prepared",
    "read_rows": "core.data.prepared",
    "record": "core.data.prepared",
    "sequence_sums": "core.data.packing",
    "split_key": "core.data.split",
    "validate_row": "core.data.formats",
})
