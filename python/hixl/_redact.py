"""URLs as hixl prints them: a password in a URL's userinfo never reaches an error, a log line
or a repr (``etcd://user:PASSWORD@host:2379/x`` is shown as ``etcd://user:***@host:2379/x``)."""

from __future__ import annotations

from urllib.parse import urlsplit

#: what a redacted password reads as
MASK = "***"


def redact_url(url: str) -> str:
    """`url` with the password of its userinfo replaced by ``***`` (the user name is kept:
    it says which account was tried). Text that is not a URL with userinfo comes back as is;
    userinfo that cannot be told from the rest is masked whole."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:  # e.g. an unbalanced "[" in the host part: mask all before the "@"
        if "@" not in url:
            return url
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}{MASK}@{rest.rpartition('@')[2]}" if sep else MASK
    if "@" not in netloc:
        return url
    creds, _, hosts = netloc.rpartition("@")
    user, colon, _ = creds.partition(":")
    shown = f"{user}:{MASK}" if colon else user
    return url.replace(netloc, f"{shown}@{hosts}", 1)


def scrub(text: str, url: str) -> str:
    """`text` (say, an error about `url`) with `url` redacted and its password masked
    wherever else it appears (an error may quote the URL's parts)."""
    text = text.replace(url, redact_url(url))
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, MASK) if password else text
