//! The keys that seal webhook signing secrets at rest, and the sealed form a store keeps.
//!
//! A secret is stored as `v1:<key id>:<nonce>:<ciphertext>` (hex): ChaCha20-Poly1305 under
//! the keyring's current key, with a random nonce, and the webhook's id as associated data, so
//! a sealed secret opens only in its own row. The key id (the first 4 bytes of the key's
//! SHA-256) says which key sealed it: previous keys only open, and a store seals again under
//! the current key what they sealed (`WebhookAdmin::seal_webhook_secrets`), after which they can
//! be dropped. `clear:<secret>` is a secret written before secrets were sealed (the migration
//! marked it); it opens as is until it is sealed.
//!
//! Nothing here prints a key: `Debug` shows key ids only.

use std::fmt;

use aws_lc_rs::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

use crate::{Error, Result};

/// The bytes of a key.
pub const KEY_LEN: usize = 32;
const SEALED_PREFIX: &str = "v1:";
const CLEAR_PREFIX: &str = "clear:";

/// A 32-byte key.
#[derive(Clone)]
pub struct Key {
    id: String,
    bytes: [u8; KEY_LEN],
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.id)
    }
}

impl Key {
    /// Reads a key written as 64 hex digits (surrounding whitespace, such as a file's final
    /// newline, is ignored).
    pub fn from_hex(text: &str) -> Result<Key> {
        let text = text.trim();
        let bytes = decode_hex(text)
            .and_then(|bytes| <[u8; KEY_LEN]>::try_from(bytes).ok())
            .ok_or_else(|| {
                Error::Secrets(format!(
                    "a key must be {} hex digits ({KEY_LEN} bytes), found {} characters{}",
                    2 * KEY_LEN,
                    text.chars().count(),
                    if text.chars().all(|c| c.is_ascii_hexdigit()) {
                        ""
                    } else {
                        " that are not all hex digits"
                    }
                ))
            })?;
        Ok(Key::of(bytes))
    }

    /// A new random key.
    pub fn generate() -> Result<Key> {
        let mut bytes = [0; KEY_LEN];
        aws_lc_rs::rand::fill(&mut bytes)
            .map_err(|_| Error::Secrets("the system's random generator failed".to_owned()))?;
        Ok(Key::of(bytes))
    }

    fn of(bytes: [u8; KEY_LEN]) -> Key {
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &bytes);
        Key {
            id: encode_hex(&digest.as_ref()[..4]),
            bytes,
        }
    }

    /// The key as `from_hex` reads it.
    pub fn to_hex(&self) -> String {
        encode_hex(&self.bytes)
    }

    /// Names the key in sealed secrets and messages without revealing it.
    pub fn id(&self) -> &str {
        &self.id
    }

    fn cipher(&self) -> LessSafeKey {
        let key = UnboundKey::new(&CHACHA20_POLY1305, &self.bytes)
            .expect("ChaCha20-Poly1305 takes a 32-byte key");
        LessSafeKey::new(key)
    }
}

/// The key that seals, and the previous keys that still open what they sealed.
#[derive(Debug, Clone)]
pub struct Keyring {
    current: Key,
    previous: Vec<Key>,
}

impl Keyring {
    pub fn new(current: Key, previous: Vec<Key>) -> Result<Keyring> {
        let mut ids = vec![current.id()];
        for key in &previous {
            if ids.contains(&key.id()) {
                return Err(Error::Secrets(format!(
                    "key {} is given twice (as the current key or a previous one)",
                    key.id()
                )));
            }
            ids.push(key.id());
        }
        Ok(Keyring { current, previous })
    }

    pub fn current(&self) -> &Key {
        &self.current
    }

    /// How every secret the current key sealed begins.
    pub fn current_prefix(&self) -> String {
        format!("{SEALED_PREFIX}{}:", self.current.id)
    }

    /// Seals `secret` under the current key, for the row `context` names.
    pub fn seal(&self, context: &str, secret: &str) -> Result<String> {
        let mut nonce = [0; NONCE_LEN];
        aws_lc_rs::rand::fill(&mut nonce)
            .map_err(|_| Error::Secrets("the system's random generator failed".to_owned()))?;
        let mut sealed = secret.as_bytes().to_vec();
        self.current
            .cipher()
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(context.as_bytes()),
                &mut sealed,
            )
            .map_err(|_| Error::Secrets("sealing a secret failed".to_owned()))?;
        Ok(format!(
            "{}{}:{}",
            self.current_prefix(),
            encode_hex(&nonce),
            encode_hex(&sealed)
        ))
    }

    /// The secret `stored` holds for the row `context` names.
    pub fn open(&self, context: &str, stored: &str) -> Result<String> {
        if let Some(clear) = stored.strip_prefix(CLEAR_PREFIX) {
            return Ok(clear.to_owned());
        }
        let parts: Option<Vec<&str>> = stored
            .strip_prefix(SEALED_PREFIX)
            .map(|rest| rest.split(':').collect());
        let Some([id, nonce, sealed]) = parts.as_deref() else {
            return Err(Error::Secrets(
                "expected a sealed secret (v1:<key id>:<nonce>:<ciphertext>) or a secret in clear \
                 (clear:…), found neither"
                    .to_owned(),
            ));
        };
        let key = std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|key| key.id == *id)
            .ok_or_else(|| {
                let known: Vec<&str> = std::iter::once(&self.current)
                    .chain(&self.previous)
                    .map(Key::id)
                    .collect();
                Error::Secrets(format!(
                    "sealed with key {id}, which is not one of this process's keys ({})",
                    known.join(", ")
                ))
            })?;
        let damaged = || {
            Error::Secrets(format!(
                "does not open with key {id}: it was altered, or sealed for another row"
            ))
        };
        let nonce = decode_hex(nonce)
            .and_then(|n| Nonce::try_assume_unique_for_key(&n).ok())
            .ok_or_else(damaged)?;
        let mut sealed = decode_hex(sealed).ok_or_else(damaged)?;
        let opened = key
            .cipher()
            .open_in_place(nonce, Aad::from(context.as_bytes()), &mut sealed)
            .map_err(|_| damaged())?;
        String::from_utf8(opened.to_vec()).map_err(|_| damaged())
    }
}

fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyring(current: &Key, previous: &[&Key]) -> Keyring {
        Keyring::new(
            current.clone(),
            previous.iter().map(|k| (*k).clone()).collect(),
        )
        .unwrap()
    }

    #[test]
    fn a_sealed_secret_opens_only_with_its_key_and_in_its_row() {
        let old = Key::generate().unwrap();
        let new = Key::generate().unwrap();
        let sealed = keyring(&old, &[]).seal("whk_1", "whsec_abc").unwrap();
        assert!(sealed.starts_with(&format!("v1:{}:", old.id())), "{sealed}");
        assert!(!sealed.contains("whsec_abc"));
        assert_ne!(
            keyring(&old, &[]).seal("whk_1", "whsec_abc").unwrap(),
            sealed,
            "a fresh nonce each time"
        );

        assert_eq!(
            keyring(&old, &[]).open("whk_1", &sealed).unwrap(),
            "whsec_abc"
        );
        assert_eq!(
            keyring(&new, &[&old]).open("whk_1", &sealed).unwrap(),
            "whsec_abc",
            "a previous key still opens"
        );
        let missing = keyring(&new, &[]).open("whk_1", &sealed).unwrap_err();
        assert!(
            missing.to_string().contains(&format!(
                "sealed with key {}, which is not one of this process's keys ({})",
                old.id(),
                new.id()
            )),
            "{missing}"
        );
        let moved = keyring(&old, &[]).open("whk_2", &sealed).unwrap_err();
        assert!(
            moved.to_string().contains("sealed for another row"),
            "{moved}"
        );
        let mut altered = sealed.clone();
        let last = altered.pop().unwrap();
        altered.push(if last == '0' { '1' } else { '0' });
        assert!(keyring(&old, &[]).open("whk_1", &altered).is_err());
        assert_eq!(
            keyring(&old, &[])
                .open("whk_1", "clear:whsec_legacy")
                .unwrap(),
            "whsec_legacy"
        );
        assert!(keyring(&old, &[]).open("whk_1", "whsec_legacy").is_err());
    }

    #[test]
    fn keys_are_read_as_64_hex_digits_and_never_shown() {
        let key = Key::generate().unwrap();
        let read = Key::from_hex(&format!("{}\n", key.to_hex().to_uppercase())).unwrap();
        assert_eq!((read.id(), read.bytes), (key.id(), key.bytes));
        assert_eq!(format!("{key:?}"), format!("Key({})", key.id()));
        for (text, says) in [
            ("", "found 0 characters"),
            ("abcd", "found 4 characters"),
            (
                &"g".repeat(64),
                "64 hex digits (32 bytes), found 64 characters that are not all hex",
            ),
            (&"0".repeat(66), "found 66 characters"),
        ] {
            let error = Key::from_hex(text).unwrap_err().to_string();
            assert!(error.contains(says), "{text:?}: {error}");
        }
        let twice = Keyring::new(key.clone(), vec![read]).unwrap_err();
        assert!(twice.to_string().contains("given twice"), "{twice}");
    }
}
