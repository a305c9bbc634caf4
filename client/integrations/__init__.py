"""Integrations with the training frameworks that need more than an iterable.

``RemoteLoader`` is passed as it is to Lightning, Accelerate and torchrun scripts
(docs/frameworks.md). A framework that builds its own ``DataLoader`` from a dataset has a
module here, importing that framework and nothing of the server side:
``remoteloader.integrations.transformers`` (``RemoteTrainer``, for Hugging Face's ``Trainer``).
This package imports none of them, and the client never imports this package.
"""
