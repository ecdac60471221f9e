//! E2B's `Idempotency-Key` on `POST /sandboxes`: a create retried with the same key (the SDK's
//! HTTP client retries, or the caller's own retry after a timeout) gets the sandbox the first
//! one made, never a second sandbox, also when the retry arrives while the first still boots.
//!
//! Owns: the key table (one slot per key: an async lock held while that key's create runs, then
//! the sandbox id it made). Bounded: keys of at most [`MAX_KEY_LEN`] bytes, at most
//! [`MAX_KEYS`] slots; a full table forgets slots older than [`KEEP`], then the oldest idle one,
//! and refuses a new key only when every slot has a create in flight. Kept in memory: a daemon
//! restart forgets the keys (a retry after one makes a new sandbox).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Longest key taken (E2B's SDKs send UUIDs).
pub const MAX_KEY_LEN: usize = 256;
/// Most keys remembered at once.
pub const MAX_KEYS: usize = 1024;
/// How long a key is remembered at least, while the table has room.
pub const KEEP: Duration = Duration::from_secs(24 * 3600);

/// A key's slot: locked while its create runs; then the id of the sandbox it made.
pub type Slot = Arc<tokio::sync::Mutex<Option<String>>>;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("Idempotency-Key must be 1-{MAX_KEY_LEN} bytes")]
    Length,
    #[error("too many creates with an Idempotency-Key in flight ({MAX_KEYS}); retry later")]
    Full,
}

/// The key table (see the module doc).
#[derive(Debug, Default)]
pub struct Keys {
    slots: Mutex<HashMap<String, (Instant, Slot)>>,
}

impl Keys {
    /// The slot of `key`, made at `now` when the key is new.
    pub fn slot(&self, key: &str, now: Instant) -> Result<Slot, KeyError> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(KeyError::Length);
        }
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, s)) = slots.get(key) {
            return Ok(s.clone());
        }
        // A slot only the table holds has no create in flight.
        let idle = |s: &Slot| Arc::strong_count(s) == 1;
        if slots.len() >= MAX_KEYS {
            slots.retain(|_, (made, s)| now.saturating_duration_since(*made) < KEEP || !idle(s));
        }
        if slots.len() >= MAX_KEYS {
            let oldest = slots
                .iter()
                .filter(|(_, (_, s))| idle(s))
                .min_by_key(|(_, (made, _))| *made)
                .map(|(k, _)| k.clone())
                .ok_or(KeyError::Full)?;
            slots.remove(&oldest);
        }
        let s = Slot::default();
        slots.insert(key.to_owned(), (now, s.clone()));
        Ok(s)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_retry_waits_for_the_first_create_and_gets_its_sandbox() {
        let keys = Arc::new(Keys::default());
        let now = Instant::now();
        let created = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let run = |keys: Arc<Keys>, created: Arc<std::sync::atomic::AtomicUsize>| async move {
            let slot = keys.slot("k1", now).unwrap();
            let mut done = slot.lock().await;
            if let Some(id) = done.as_ref() {
                return id.clone();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let n = created.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let id = format!("sbx_{n}");
            *done = Some(id.clone());
            id
        };
        let (a, b) = tokio::join!(
            run(keys.clone(), created.clone()),
            run(keys.clone(), created.clone())
        );
        assert_eq!(a, b);
        assert_eq!(created.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Another key is another create.
        let other = keys.slot("k2", now).unwrap();
        assert!(other.lock().await.is_none());
    }

    #[test]
    fn keys_are_bounded_in_length_and_number() {
        let keys = Keys::default();
        let t0 = Instant::now();
        assert_eq!(keys.slot("", t0).unwrap_err(), KeyError::Length);
        assert_eq!(
            keys.slot(&"x".repeat(MAX_KEY_LEN + 1), t0).unwrap_err(),
            KeyError::Length
        );
        // A full table of fresh idle keys forgets the oldest.
        for i in 0..MAX_KEYS {
            keys.slot(&format!("k{i}"), t0 + Duration::from_millis(i as u64))
                .unwrap();
        }
        assert_eq!(keys.len(), MAX_KEYS);
        let later = t0 + Duration::from_secs(1);
        let kept = keys.slot("k5", later).unwrap();
        keys.slot("new", later).unwrap();
        assert_eq!(keys.len(), MAX_KEYS);
        // k0 went (the oldest), k5 is still the same slot.
        assert!(Arc::ptr_eq(&kept, &keys.slot("k5", later).unwrap()));
        let k0 = keys.slot("k0", later).unwrap(); // made anew, evicting k1
        assert!(k0.try_lock().unwrap().is_none());
        // Past KEEP every idle key goes at once.
        let much_later = t0 + KEEP + Duration::from_secs(5);
        drop((kept, k0));
        keys.slot("fresh", much_later).unwrap();
        assert!(keys.len() <= 3, "{}", keys.len());
        // Every slot with a create in flight: a new key is refused, not an eviction.
        let keys = Keys::default();
        let held: Vec<Slot> = (0..MAX_KEYS)
            .map(|i| keys.slot(&format!("h{i}"), t0).unwrap())
            .collect();
        assert_eq!(keys.slot("one-more", t0).unwrap_err(), KeyError::Full);
        drop(held);
        assert!(keys.slot("one-more", t0).is_ok());
    }
}
