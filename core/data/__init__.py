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

Names load on first use (posttrain.core.lazy): `posttrain.core.data.config` (DataConfig) imports without torch.
"""

from posttrain.core.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "AdapterRouting": "posttrain.core.data.routing",
    "BatchSampler": "posttrain.core.data.sampler",
    "DataError": "posttrain.core.data.errors",
    "Document": "posttrain.core.data.encode",
    "DropStats": "posttrain.core.data.errors",
    "Encoder": "posttrain.core.data.encode",
    "ExamplePipeline": "posttrain.core.data.dataset",
    "FORMATS": "posttrain.core.data.formats",
    "Loader": "posttrain.core.data.loader",
    "PreferencePair": "posttrain.core.data.encode",
    "PreparedData": "posttrain.core.data.dataset",
    "REASONS": "posttrain.core.data.errors",
    "SPLITS": "posttrain.core.data.split",
    "StatefulLoader": "posttrain.core.data.sampler",
    "assign_split": "posttrain.core.data.split",
    "build_loader": "posttrain.core.data.loader",
    "canonical_split": "posttrain.core.data.split",
    "collate_padded": "posttrain.core.data.packing",
    "collate_padding_free": "posttrain.core.data.packing",
    "collate_preference": "posttrain.core.data.packing",
    "common_prefix": "posttrain.core.data.formats",
    "content_hash": "posttrain.core.data.split",
    "detect_format": "posttrain.core.data.formats",
    "fit_pair": "posttrain.core.data.prepared",
    "for_each_example": "posttrain.core.data.dataset",
    "load_data": "posttrain.core.data.dataset",
    "load_documents": "posttrain.core.data.prepared",
    "load_pairs": "posttrain.core.data.prepared",
    "load_splits": "posttrain.core.data.prepared",
    "make_encoder": "posttrain.core.data.dataset",
    "num_tokens": "posttrain.core.data.encode",
    "open_sources": "posttrain.core.data.sources",
    "output_key": "posttrain.core.data.prepared",
    "pack": "posttrain.core.data.packing",
    "prepared_files": "posttrain.core.data.prepared",
    "read_documents": "posttrain.core.data.prepared",
    "read_pairs": "posttrain.core.data.prepared",
    "read_rows": "posttrain.core.data.prepared",
    "record": "posttrain.core.data.prepared",
    "sequence_sums": "posttrain.core.data.packing",
    "split_key": "posttrain.core.data.split",
    "validate_row": "posttrain.core.data.formats",
})
