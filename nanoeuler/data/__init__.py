"""The data path: the bundled corpus (`corpus.py`), named public sources (`sources.py`) fetched by a resumable
downloader (`download.py`), and text -> token shards and back (`shards.py`)."""
