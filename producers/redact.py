"""Secrets out of what a command prints: DSNs, URLs and client options shown without the
passwords, tokens and keys they carry.

Every message that names a store, a Grafana, a Kafka or a client option goes through
these functions first, so a password reaches no terminal, log line, exception text, path
or metric label. Light on purpose (the standard library only): the sidecar, the worker,
the CLI and the dashboards use it alike.

>>> redact_url("http://lagscope:pw@clickhouse:8123/lagscope?password=pw2&database=x")
'http://lagscope:***@clickhouse:8123/lagscope?password=***&database=x'
>>> is_secret_key("sasl.password"), is_secret_key("ssl.key.pem"), is_secret_key("linger.ms")
(True, True, False)
>>> scrub("login of 'admin' with hunter2 failed", ["hunter2"])
"login of 'admin' with *** failed"
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

#: What replaces a secret in every message.
MASK = "***"

#: Option and query keys whose values are secrets: librdkafka's `sasl.password`,
#: `ssl.key.password`, `ssl.key.pem`, `ssl.keystore.password`,
#: `sasl.oauthbearer.client.secret`, `sasl.oauthbearer.config`, Java's `sasl.jaas.config`,
#: and the usual names of passwords and tokens in URLs.
_SECRET_KEY = re.compile(
    r"pass|pwd|secret|token|credential|jaas|oauthbearer\.config|api[._-]?key|"
    r"(^|[._-])key(\.pem)?$|private",
    re.IGNORECASE,
)

#: `scheme://user:password@` anywhere in a text (a URL inside a longer message).
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@'\"]*):(?P<pw>[^/\s'\"]*)@")
#: `key=value` in a query string or an option list.
_KEY_VALUE = re.compile(r"(?P<key>[A-Za-z0-9_.-]+)=(?P<value>[^&\s'\"]*)")


def is_secret_key(key: str) -> bool:
    """Whether an option or query parameter named `key` holds a secret."""
    return bool(_SECRET_KEY.search(key))


def redact_url(text: str) -> str:
    """`text` (a URL, a DSN, or a message that quotes one) with the password of every
    `scheme://user:password@` and the value of every secret-named `key=value` masked."""
    text = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    return _KEY_VALUE.sub(lambda m: f"{m['key']}={MASK}" if is_secret_key(m["key"]) else m[0], text)


def secret_values(options: Mapping[str, Any]) -> list[str]:
    """The values of the secret-named entries of a client's options (for `scrub`)."""
    found = []
    for key, value in options.items():
        if value is None or not is_secret_key(str(key)):
            continue
        shown = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        if str(shown):
            found.append(str(shown))
    return found


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """`text` with every occurrence of each secret masked, longest first (a message from a
    library may quote a value it was given), and every URL's password too."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return redact_url(text)
