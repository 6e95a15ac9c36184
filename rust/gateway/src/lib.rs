//! lightning-gateway: the recording OpenAI-compatible proxy and its SQLite store.
