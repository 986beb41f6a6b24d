"""`--cache-salt-per-api-key KEYS_FILE`: several API keys, each its tenant's, and every
request salted with its key's tenant.

Requests with different cache salts never share a KV block (the salt enters the hash of
block 0, cache/hashing.make_extra_key). Without per-tenant salts, one tenant could learn
from its time to first token whether another tenant's prompt is cached. The file, private
like --api-key-file (mode 0600), holds one key a line after its tenant's name:

    # tenant   key
    acme       sk-acme-2f8a0c7e41d94b6f
    acme       sk-acme-rotated-9c1e5d2b7a   (a tenant may have several keys: one cache)
    globex     sk-globex-71c0a9e3f25b48d6

A request's own `cache_salt` combines with its tenant's (`salted`), never replaces it, so
no tenant can choose a salt that another tenant's requests carry.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from wire.security import InsecureFileError, read_private_file

FLAG = "--cache-salt-per-api-key"
MIN_KEY_CHARS = 16  # a key is a bearer secret: not a word someone could guess
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


@dataclass(frozen=True)
class Tenants:
    """Who each key belongs to. Keys are held by their sha256 only: a lookup's time
    depends on the digest of the guess, never on how much of a real key the guess
    matches, and the keys themselves are not kept."""

    by_digest: dict[bytes, str] = field(repr=False)

    @property
    def names(self) -> list[str]:
        return sorted(set(self.by_digest.values()))

    def tenant_of(self, key: str) -> str | None:
        return self.by_digest.get(_digest(key))

    @classmethod
    def from_text(cls, text: str, where: str = FLAG) -> Tenants:
        """Parse a keys file: `TENANT KEY` per line, `#` comments, blank lines. Errors name
        the line, never the key."""
        by_digest: dict[bytes, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"{where}, line {number}: expected 'TENANT KEY', got "
                                 f"{len(fields)} fields")
            name, key = fields
            if not _TENANT_NAME.fullmatch(name):
                raise ValueError(f"{where}, line {number}: a tenant name is 1-64 letters, "
                                 f"digits or ._@- (starting with a letter or digit)")
            if len(key) < MIN_KEY_CHARS:
                raise ValueError(f"{where}, line {number}: the key is shorter than "
                                 f"{MIN_KEY_CHARS} characters")
            digest = _digest(key)
            if digest in by_digest:
                raise ValueError(f"{where}, line {number}: this key is already given, for "
                                 f"tenant {by_digest[digest]!r}")
            by_digest[digest] = name
        if not by_digest:
            raise ValueError(f"{where}: no keys in it")
        return cls(by_digest)

    @classmethod
    def from_file(cls, path: str) -> Tenants:
        """The file's tenants; SystemExit with one clear line if it is not private or not
        well formed (the launcher checks it before starting anything, the shim again)."""
        try:
            return cls.from_text(read_private_file(path, FLAG), f"{FLAG} {path}")
        except (InsecureFileError, ValueError) as exc:
            raise SystemExit(str(exc)) from None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def salted(tenants: Tenants | None, tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt a request's blocks are hashed under.

    Without a keys file, the request's own salt. With one, every request's salt is the
    JSON of [its tenant, its own salt]: a JSON list of strings (or nulls) decodes one way
    only, so two requests share blocks only if both tenant and salt agree. The tenant is
    None for the operator's --api-key (and the start-up self-check): a cache of its own."""
    if tenants is None:
        return cache_salt
    return json.dumps([tenant, cache_salt], ensure_ascii=False)


def tenant_session(tenant: str | None, session: str) -> str:
    """The session key under a tenant: the prefix tracker and the queue's round robin
    never mix two tenants' conversations, even ones that start alike."""
    return session if tenant is None else f"tenant={tenant}|{session}"
