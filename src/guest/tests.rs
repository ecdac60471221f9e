//! Host-only tests of the real agent code against the real client.
