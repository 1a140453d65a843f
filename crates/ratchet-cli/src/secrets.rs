//! The keys that seal webhook signing secrets at rest, for `serve`: the current key from
//! `RATCHET_SECRETS_KEY` or `[secrets] key_file`, and the keys it replaces from
//! `RATCHET_SECRETS_PREVIOUS_KEYS` or `[secrets] previous_key_files` during a rotation.
//!
//! Without a configured key, a SQLite database gets a key file of its own, made beside it on
//! first start (owner-only), so secrets are never stored in clear. A PostgreSQL database is
//! shared by processes that may run on other machines, where a generated file would not be:
//! it needs a configured key. A key file another user can read is refused, like a malformed
//! one.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use ratchet::SecretsSettings;
use ratchet_store::{Key, Keyring};

pub const KEY_VARIABLE: &str = "RATCHET_SECRETS_KEY";
pub const PREVIOUS_KEYS_VARIABLE: &str = "RATCHET_SECRETS_PREVIOUS_KEYS";

/// The keyring, and where its current key came from (for the start-up message).
pub struct Loaded {
    pub keyring: Keyring,
    pub source: Source,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Source {
    Variable,
    File(PathBuf),
    /// Made now, because the database had no key yet.
    Generated(PathBuf),
}

/// The keyring `settings` and the environment describe; for a database without one,
/// `generated` is where its own key file is kept (None: the database needs a configured key).
pub fn load(
    settings: &SecretsSettings,
    env: impl Fn(&str) -> Option<String>,
    generated: Option<&Path>,
) -> anyhow::Result<Loaded> {
    let (current, source) = match (env(KEY_VARIABLE), &settings.key_file) {
        (Some(text), _) => (
            Key::from_hex(&text).with_context(|| format!("{KEY_VARIABLE} is not a key"))?,
            Source::Variable,
        ),
        (None, Some(file)) => (read_key_file(Path::new(file))?, Source::File(file.into())),
        (None, None) => match generated {
            Some(path) if path.exists() => (read_key_file(path)?, Source::File(path.into())),
            Some(path) => (make_key_file(path)?, Source::Generated(path.into())),
            None => bail!(
                "webhook secrets are stored sealed, and this database needs a key to seal them: \
                 set {KEY_VARIABLE} (64 hex digits, e.g. from `openssl rand -hex 32`) or \
                 [secrets] key_file, the same for every process that serves this database"
            ),
        },
    };
    let previous = match env(PREVIOUS_KEYS_VARIABLE) {
        Some(list) => (list.split(','))
            .map(str::trim)
            .filter(|text| !text.is_empty())
            .enumerate()
            .map(|(i, text)| {
                Key::from_hex(text)
                    .with_context(|| format!("{PREVIOUS_KEYS_VARIABLE}: entry {i} is not a key"))
            })
            .collect::<anyhow::Result<Vec<Key>>>()?,
        None => (settings.previous_key_files.iter())
            .map(|file| read_key_file(Path::new(file)))
            .collect::<anyhow::Result<Vec<Key>>>()?,
    };
    Ok(Loaded {
        keyring: Keyring::new(current, previous)?,
        source,
    })
}

/// A key file: 64 hex digits, readable by its owner only.
fn read_key_file(path: &Path) -> anyhow::Result<Key> {
    let metadata = std::fs::metadata(path)
        .with_context(|| format!("cannot read the secrets key file {}", path.display()))?;
    if !metadata.is_file() {
        bail!("the secrets key file {} is not a file", path.display());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            bail!(
                "the secrets key file {} can be read or written by other users (mode {mode:o}); \
                 expected its owner alone: `chmod 600 {}`",
                path.display(),
                path.display()
            );
        }
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the secrets key file {}", path.display()))?;
    Key::from_hex(&text).with_context(|| format!("the secrets key file {}", path.display()))
}

/// Makes a new key file at `path`, owner-only, or reads the one a process starting at the
/// same time made: the file appears whole or not at all (written aside, then linked).
fn make_key_file(path: &Path) -> anyhow::Result<Key> {
    let key = Key::generate()?;
    let aside = path.with_extension(format!("key-{}", std::process::id()));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let written = options.open(&aside).and_then(|mut file| {
        use std::io::Write;
        file.write_all(format!("{}\n", key.to_hex()).as_bytes())?;
        file.sync_all()
    });
    let linked = written.and_then(|()| std::fs::hard_link(&aside, path));
    let _ = std::fs::remove_file(&aside);
    match linked {
        Ok(()) => Ok(key),
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => read_key_file(path),
        Err(error) => Err(error)
            .with_context(|| format!("cannot write the secrets key file {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(key_file: Option<&Path>, previous: &[&Path]) -> SecretsSettings {
        SecretsSettings {
            key_file: key_file.map(|p| p.display().to_string()),
            previous_key_files: previous.iter().map(|p| p.display().to_string()).collect(),
        }
    }

    fn write_key(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
    }

    fn error(loaded: anyhow::Result<Loaded>) -> String {
        format!("{:#}", loaded.err().expect("refused"))
    }

    /// Without a key, a SQLite database's own key file is made once, owner-only, and read
    /// at every later start; a database on a server needs a configured key.
    #[test]
    fn a_database_without_a_configured_key_gets_its_own_key_file_or_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ratchet.db.key");
        let none = |_: &str| None;
        let first = load(&SecretsSettings::default(), none, Some(&path)).unwrap();
        assert_eq!(first.source, Source::Generated(path.clone()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        let again = load(&SecretsSettings::default(), none, Some(&path)).unwrap();
        assert_eq!(again.source, Source::File(path.clone()));
        assert_eq!(again.keyring.current().id(), first.keyring.current().id());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "nothing is left aside"
        );

        let refused = error(load(&SecretsSettings::default(), none, None));
        assert!(
            refused.contains("needs a key") && refused.contains(KEY_VARIABLE),
            "{refused}"
        );
    }

    #[test]
    fn keys_come_from_the_environment_or_files_and_bad_ones_are_refused_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let (current, old) = (Key::generate().unwrap(), Key::generate().unwrap());
        let current_file = dir.path().join("current.key");
        let old_file = dir.path().join("old.key");
        write_key(&current_file, &format!("{}\n", current.to_hex()), 0o600);
        write_key(&old_file, &old.to_hex(), 0o400);

        let loaded = load(&settings(Some(&current_file), &[&old_file]), |_| None, None).unwrap();
        assert_eq!(loaded.keyring.current().id(), current.id());
        let sealed = Keyring::new(old.clone(), Vec::new())
            .unwrap()
            .seal("whk_1", "s")
            .unwrap();
        assert_eq!(loaded.keyring.open("whk_1", &sealed).unwrap(), "s");

        let env = |name: &str| match name {
            KEY_VARIABLE => Some(old.to_hex()),
            PREVIOUS_KEYS_VARIABLE => Some(format!(" {} ,", current.to_hex())),
            _ => None,
        };
        let from_env = load(&settings(Some(&current_file), &[]), env, None).unwrap();
        assert_eq!(from_env.source, Source::Variable);
        assert_eq!(
            from_env.keyring.current().id(),
            old.id(),
            "the variable wins"
        );

        let open_file = dir.path().join("open.key");
        write_key(&open_file, &current.to_hex(), 0o644);
        let malformed = dir.path().join("malformed.key");
        write_key(&malformed, "not a key\n", 0o600);
        for (settings, env, says) in [
            (
                settings(Some(&open_file), &[]),
                None,
                "can be read or written by other users (mode 644)",
            ),
            (
                settings(Some(&malformed), &[]),
                None,
                "malformed.key: webhook secrets: a key must be 64 hex digits",
            ),
            (
                settings(Some(&dir.path().join("missing.key")), &[]),
                None,
                "cannot read the secrets key file",
            ),
            (
                settings(Some(&current_file), &[&current_file]),
                None,
                "is given twice",
            ),
            (
                settings(None, &[]),
                Some("abc"),
                "RATCHET_SECRETS_KEY is not a key",
            ),
        ] {
            let env = |name: &str| match name {
                KEY_VARIABLE => env.map(str::to_owned),
                _ => None,
            };
            let refused = error(load(&settings, env, None));
            assert!(refused.contains(says), "{says}: {refused}");
        }
    }
}
