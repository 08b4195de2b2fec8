"""Token data: preparing memmapped corpora, sampling and batching them."""
