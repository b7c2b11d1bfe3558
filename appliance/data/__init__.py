"""Training data: files → records → tokens → packed rows.

listing.py    which files a --data names (dirs, globs, hub datasets), the notes about them
files.py      what is a data file (jsonl, json, parquet, arrow, csv, tsv, txt, compressed),
              reading them line by line, counting their documents
delimited.py  CSV and TSV rows as records
records.py    one document or conversation per record (text, prompt + completion, messages,
              ShareGPT, Alpaca), checked, tokenized, held out
chat.py       chat templates (rendered as transformers renders them), conversations of any
              shape (FieldMap), and which tokens train
templates.py  chat templates by name (chatml, llama3, gemma, mistral)
packing.py    documents packed into rows of --seq-len tokens
"""

from appliance.data.chat import ChatError, ChatTemplate, load_chat_template
from appliance.data.files import data_format
from appliance.data.listing import find_data_files, resolve_dataset
from appliance.data.packing import fill_rows, split_document
from appliance.data.records import BadRecord, Holdout, Record, load_tokenizer

__all__ = [
    "BadRecord",
    "ChatError",
    "ChatTemplate",
    "Holdout",
    "Record",
    "data_format",
    "fill_rows",
    "find_data_files",
    "load_chat_template",
    "load_tokenizer",
    "resolve_dataset",
    "split_document",
]
