"""Level 2, bitwise: every shard of DST equals its region of SRC, bit for bit, streamed.

The work is cut into *blocks* of the global tensors — ``rows`` consecutive indices along one dim
(dim 0 unless one index of it is over ``BLOCK_BYTES``), whole along the dims after it. Each
block is handled once:

1. its SRC image is read once: one ``pread`` per SRC piece straight into the image when the
   piece holds whole rows (an HF source: always), else the piece's local rows and a copy;
2. every DST shard holding part of the block reads its local rows of it (contiguous in its
   file) once, and each of its pieces is compared with its region of the image: ``memcmp``
   when both sides are contiguous, integer numpy views otherwise. Replicas are each compared
   with SRC, so all are identical to it and to each other;
3. where the record gives per-file digests (``hashes``), the DST bytes just read are fed to
   that file's hash in file order — no second read; bytes no block reads (headers,
   alignment, padding) are read into the hash as the gaps go by. A file whose blocks do not
   come in file order (hand-made layouts) is hashed again from the start at the end.

So each SRC byte and each DST byte is read once. Blocks run on up to ``MAX_THREADS`` threads
(reads, ``memcmp``, numpy compares and hashing all release the GIL); the hash updates happen in
block order, by whichever thread finds the hashing free (``_Pipeline``), so a file's hash sees
its bytes in order while the next blocks are already being read. Memory: threads + 1 buffer
sets, each one SRC image (``BLOCK_BYTES``), the DST rows of one block (``DST_CAP_BYTES``) and a
copy buffer, each its own mapping (given back whole) — bounded, whatever the model size
(~20 MiB of buffers with 2 threads at 90,000 tensors, where a set is ~7 MiB).

Where the time goes (4.2 GB llama, HF -> TP4, page cache warm, 2 cores): reading SRC and DST
costs what ``cat`` costs (~0.9 CPU-s), comparing ~0.3, Python ~0.15, and the record hashes
(XXH3-128, ~27 GB/s a core) ~0.15; a BLAKE3 record (older layouts, ~2.7 GB/s here) ~1.5.

Also checked: local regions no piece covers (vocab padding) are zero. Integer views only (see
``boxes``). A DST shard is reported once: how many of its elements differ, over all its blocks,
and the first (global index, value, source value).

Modules: ``plan`` (pieces and blocks, ``fill_image``), ``compare`` (one task's reads and
checks), ``pipeline`` (threads, hashing in file order), ``level`` (``check_bitwise``).
"""
