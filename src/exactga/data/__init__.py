"""From dataset rows to the micro-batches of a window: the loader and its data order, row checks,
micro-batching, packing, collation and length-balanced ranks."""
