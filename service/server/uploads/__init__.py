"""An upload's files, checked before a job is queued: the multipart form (``multipart``),
each file streamed to disk under a server-chosen name (``files``), its format told by its
bytes (``sniff``), then read with the project's own safe loaders (``checks``: one per kind of
file; the model's formats in ``checkpoints``, ``programs``, ``onnx_checks`` and
``pretrained``). Each problem is an ``UploadRejected`` that says what to do."""
