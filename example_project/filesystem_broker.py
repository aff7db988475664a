"""The demo's server-less broker: kombu's filesystem transport, with each message file whole before a consumer sees it.

kombu's ``_put`` (kombu 5.7) creates the message file, then locks and writes it; its ``_get`` moves any file of
the queue away and reads it without a lock. A consumer that lists the folder in between reads an empty file, and
its worker stops on the JSON error (celery/kombu#1551, open; seen in the demo's test on a loaded machine). Here a
message is written under a name no consumer looks at and renamed into place, which is atomic on one file system.
``demo.py`` selects it (``broker_transport``) when no Redis answers.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):  # type: ignore[misc]
    """kombu's filesystem channel whose messages appear whole."""

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # kombu's own name: <milliseconds>_<uuid>.<queue>.msg (its _get reads what follows the first dot)
        name = os.path.join(self.data_folder_out, f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg")
        partial = f"{name}.part"  # not "<queue>.msg" after the first dot: no consumer takes it
        try:
            with open(partial, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))
            os.replace(partial, name)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc


class Transport(filesystem.Transport):  # type: ignore[misc]
    Channel = Channel
