//! The workspace directory, and the only way the tools crate touches the filesystem: every
//! path a tool names is opened beneath a handle on the workspace, by the kernel, one component
//! at a time, never through a symbolic link. What is checked is then what is opened, however
//! the workspace changes meanwhile. It must never open a path by its full name: a path checked
//! and then opened by name can be swapped for a symbolic link in between (security probe F1).
//!
//! Linux only: it relies on `openat2` (Linux 5.6) where the kernel has it and on `O_PATH`.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// Why a file in the workspace was not opened or written. Each message says what was expected
/// and what was found; tools show it to the model as the call's outcome.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("workspace {} cannot be opened as a directory: {source}", root.display())]
    Workspace { root: PathBuf, source: io::Error },
    #[error("path {path:?} is absolute; expected a path relative to the workspace")]
    Absolute { path: String },
    #[error("path {path:?} escapes the workspace (`..` is not allowed)")]
    ParentDirectory { path: String },
    #[error("path {path:?} contains a NUL byte; expected a file name without one")]
    Nul { path: String },
    #[error("path {path:?} names a directory, not a file")]
    Directory { path: String },
    #[error("path {path:?} contains a symbolic link; links are never followed in the workspace")]
    SymbolicLink { path: String },
    #[error("a directory of path {path:?} does not exist in the workspace")]
    MissingDirectory { path: String },
    #[error("path {path:?} passes through a file as if it were a directory")]
    NotADirectory { path: String },
    #[error("path {path:?} is {found}; expected a regular file")]
    NotRegularFile { path: String, found: &'static str },
    #[error(
        "path {path:?} has {links} hard links; expected a file with one (another link could be outside the workspace)"
    )]
    HardLinked { path: String, links: u64 },
    #[error("cannot open {path:?} in the workspace: {source}")]
    Open { path: String, source: io::Error },
    #[error("cannot append to {path:?}: {source}")]
    Write { path: String, source: io::Error },
}

/// A handle on the workspace directory, opened once; files are opened beneath it.
#[derive(Debug)]
pub struct Workspace {
    root: OwnedFd,
    resolver: Resolver,
}

/// How a path is resolved beneath the workspace. Both refuse the same paths; tests run each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resolver {
    /// `openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`: the kernel resolves the whole
    /// path and refuses any link in it.
    Openat2,
    /// One `openat` per component with `O_NOFOLLOW`, each relative to the directory before:
    /// for kernels without `openat2`.
    Walk,
}

/// The mode std gives new files: the process's umask decides what others may do.
const NEW_FILE_MODE: u32 = 0o666;

impl Workspace {
    /// Opens the workspace directory itself. It is the operator's configuration, so a
    /// symbolic link here is followed; only the paths tools name beneath it are confined.
    pub fn open(root: &Path) -> Result<Workspace, Error> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let root_fd =
            rustix::fs::open(root, flags, Mode::empty()).map_err(|errno| Error::Workspace {
                root: root.to_owned(),
                source: errno.into(),
            })?;
        // Kernels before 5.6 answer ENOSYS; container sandboxes whose seccomp filter predates
        // openat2 answer EPERM. The walk is as safe, only slower.
        let resolver = match rustix::fs::openat2(
            &root_fd,
            ".",
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH,
        ) {
            Err(Errno::NOSYS | Errno::PERM) => Resolver::Walk,
            _ => Resolver::Openat2,
        };
        Ok(Workspace {
            root: root_fd,
            resolver,
        })
    }

    /// Appends `bytes` to the regular file at `relative` (created if absent) and waits until
    /// they are on disk.
    pub fn append(&self, relative: &str, bytes: &[u8]) -> Result<(), Error> {
        let mut file = self.open_append(relative)?;
        file.write_all(bytes)
            .and_then(|()| file.sync_data())
            .map_err(|source| Error::Write {
                path: relative.to_owned(),
                source,
            })
    }

    /// Opens `relative` for appending, creating it if absent. Refuses anything but a regular
    /// file with a single link.
    fn open_append(&self, relative: &str) -> Result<File, Error> {
        let path = Relative::parse(relative)?;
        // O_NONBLOCK so that a FIFO with no reader fails at once (ENXIO) instead of waiting
        // for one; for a regular file it changes nothing.
        let flags = OFlags::WRONLY
            | OFlags::APPEND
            | OFlags::CREATE
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC;
        let fd = self
            .open_beneath(&path, flags)
            .map_err(|errno| refusal(relative, errno))?;
        let file = File::from(fd);
        let metadata = file.metadata().map_err(|source| Error::Open {
            path: relative.to_owned(),
            source,
        })?;
        let found = match FileType::from_raw_mode(metadata.mode()) {
            FileType::RegularFile => None,
            FileType::Fifo => Some("a FIFO"),
            FileType::Socket => Some("a socket"),
            FileType::CharacterDevice => Some("a character device"),
            FileType::BlockDevice => Some("a block device"),
            FileType::Directory | FileType::Symlink | FileType::Unknown => {
                Some("not a regular file")
            }
        };
        if let Some(found) = found {
            return Err(Error::NotRegularFile {
                path: relative.to_owned(),
                found,
            });
        }
        // A hard link is the same file under two names, and the other name may be outside
        // the workspace: no path check can tell (security probe F8).
        if metadata.nlink() > 1 {
            return Err(Error::HardLinked {
                path: relative.to_owned(),
                links: metadata.nlink(),
            });
        }
        Ok(file)
    }

    fn open_beneath(&self, path: &Relative<'_>, flags: OFlags) -> Result<OwnedFd, Errno> {
        match self.resolver {
            Resolver::Openat2 => rustix::fs::openat2(
                &self.root,
                path.joined(),
                flags,
                Mode::from_raw_mode(NEW_FILE_MODE),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            ),
            Resolver::Walk => self.walk(path, flags),
        }
    }

    /// Opens each directory with `O_PATH | O_NOFOLLOW` relative to the one before, then the
    /// file relative to the last: no component is ever looked up by a longer name, so none
    /// can be swapped for a link between a check and the open.
    fn walk(&self, path: &Relative<'_>, flags: OFlags) -> Result<OwnedFd, Errno> {
        let mut directory: Option<OwnedFd> = None;
        for name in &path.directories {
            let parent = directory.as_ref().map_or(self.root.as_fd(), AsFd::as_fd);
            let opened = rustix::fs::openat(
                parent,
                *name,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            );
            directory = Some(match opened {
                Ok(fd) => fd,
                // O_PATH | O_NOFOLLOW takes a link as it is, and O_DIRECTORY then finds it
                // is not a directory: answer as openat2 does, so both say "symbolic link".
                Err(Errno::NOTDIR) if is_symlink(parent, name) => return Err(Errno::LOOP),
                Err(errno) => return Err(errno),
            });
        }
        let parent = directory.as_ref().map_or(self.root.as_fd(), AsFd::as_fd);
        rustix::fs::openat(
            parent,
            path.file_name,
            flags,
            Mode::from_raw_mode(NEW_FILE_MODE),
        )
    }
}

fn is_symlink(directory: BorrowedFd<'_>, name: &str) -> bool {
    rustix::fs::statat(directory, name, AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|stat| FileType::from_raw_mode(stat.st_mode) == FileType::Symlink)
}

/// What the kernel's refusal means for the path a tool named.
fn refusal(relative: &str, errno: Errno) -> Error {
    let path = relative.to_owned();
    match errno {
        // RESOLVE_NO_SYMLINKS and O_NOFOLLOW both answer ELOOP for a link.
        Errno::LOOP => Error::SymbolicLink { path },
        // The file itself is created if absent, so what is missing is a directory.
        Errno::NOENT => Error::MissingDirectory { path },
        Errno::NOTDIR => Error::NotADirectory { path },
        Errno::ISDIR => Error::Directory { path },
        // A FIFO opened O_WRONLY | O_NONBLOCK with no reader, or a socket.
        Errno::NXIO => Error::NotRegularFile {
            path,
            found: "a FIFO or socket",
        },
        errno => Error::Open {
            path,
            source: errno.into(),
        },
    }
}

/// A path as a tool names it, split into the directories it passes and its file name, with
/// `.` and empty components dropped. Its spelling alone never leaves the workspace: it has no
/// leading `/`, no `..` and no NUL.
struct Relative<'a> {
    directories: Vec<&'a str>,
    file_name: &'a str,
}

impl<'a> Relative<'a> {
    fn parse(relative: &'a str) -> Result<Relative<'a>, Error> {
        let path = relative.to_owned();
        if relative.starts_with('/') {
            return Err(Error::Absolute { path });
        }
        if relative.contains('\0') {
            return Err(Error::Nul { path });
        }
        if relative.split('/').any(|name| name == "..") {
            return Err(Error::ParentDirectory { path });
        }
        let (directories, file_name) = relative.rsplit_once('/').unwrap_or(("", relative));
        // `.`, `dir/` and `dir/.` name a directory, whatever `dir` is; so does "".
        if file_name.is_empty() || file_name == "." {
            return Err(Error::Directory { path });
        }
        let directories = directories
            .split('/')
            .filter(|name| !name.is_empty() && *name != ".")
            .collect();
        Ok(Relative {
            directories,
            file_name,
        })
    }

    /// The path as `openat2` takes it, relative to the workspace.
    fn joined(&self) -> String {
        let mut joined = String::new();
        for name in &self.directories {
            joined.push_str(name);
            joined.push('/');
        }
        joined.push_str(self.file_name);
        joined
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use rustix::fs::RenameFlags;

    /// The resolvers this kernel offers: the walk always, `openat2` where it has it.
    fn resolvers() -> Vec<Resolver> {
        match Workspace::open(Path::new(".")).unwrap().resolver {
            Resolver::Openat2 => vec![Resolver::Openat2, Resolver::Walk],
            Resolver::Walk => vec![Resolver::Walk],
        }
    }

    /// A workspace `ws` beside a directory `outside` that nothing may ever write to.
    struct Sandbox {
        _dir: tempfile::TempDir,
        ws: PathBuf,
        outside: PathBuf,
    }

    impl Sandbox {
        fn new() -> Sandbox {
            let dir = tempfile::tempdir().unwrap();
            let (ws, outside) = (dir.path().join("ws"), dir.path().join("outside"));
            std::fs::create_dir(&ws).unwrap();
            std::fs::create_dir(&outside).unwrap();
            std::fs::write(outside.join("target.txt"), "original\n").unwrap();
            Sandbox {
                _dir: dir,
                ws,
                outside,
            }
        }

        fn workspace(&self, resolver: Resolver) -> Workspace {
            Workspace {
                resolver,
                ..Workspace::open(&self.ws).unwrap()
            }
        }

        /// The names and contents of everything in `outside`, to compare before and after.
        fn outside(&self) -> Vec<(String, String)> {
            let mut entries: Vec<(String, String)> = std::fs::read_dir(&self.outside)
                .unwrap()
                .map(|entry| {
                    let path = entry.unwrap().path();
                    let name = path.file_name().unwrap().to_string_lossy().into_owned();
                    (name, std::fs::read_to_string(&path).unwrap_or_default())
                })
                .collect();
            entries.sort();
            entries
        }
    }

    fn refusal(workspace: &Workspace, path: &str) -> String {
        match workspace.append(path, b"x\n") {
            Ok(()) => panic!("{path:?} was appended to with {workspace:?}"),
            Err(refused) => refused.to_string(),
        }
    }

    #[test]
    fn appends_to_files_beneath_the_workspace() {
        let sandbox = Sandbox::new();
        std::fs::create_dir(sandbox.ws.join("sub")).unwrap();
        for resolver in resolvers() {
            let workspace = sandbox.workspace(resolver);
            for path in ["log.txt", "./log.txt", "sub//./log.txt"] {
                workspace.append(path, b"line\n").unwrap();
            }
        }
        let read = |path: &str| std::fs::read_to_string(sandbox.ws.join(path)).unwrap();
        assert_eq!(read("log.txt"), "line\n".repeat(4));
        assert_eq!(read("sub/log.txt"), "line\n".repeat(2));
    }

    #[test]
    fn paths_spelled_to_leave_the_workspace_are_refused() {
        let sandbox = Sandbox::new();
        let inside_but_absolute = sandbox.ws.join("x.txt");
        let inside_but_absolute = inside_but_absolute.to_str().unwrap();
        for resolver in resolvers() {
            let workspace = sandbox.workspace(resolver);
            for (path, expected) in [
                (
                    "/etc/x",
                    "is absolute; expected a path relative to the workspace",
                ),
                ("/", "is absolute"),
                (inside_but_absolute, "is absolute"),
                ("../x.txt", "escapes the workspace (`..` is not allowed)"),
                ("a/../../x.txt", "escapes the workspace"),
                ("./../x.txt", "escapes the workspace"),
                ("..", "escapes the workspace"),
                ("a/..", "escapes the workspace"),
                ("a\0b", "contains a NUL byte"),
            ] {
                let refused = refusal(&workspace, path);
                assert!(refused.contains(expected), "{path:?}: {refused}");
            }
        }
        assert_eq!(std::fs::read_dir(&sandbox.ws).unwrap().count(), 0);
        assert_eq!(
            sandbox.outside(),
            [("target.txt".into(), "original\n".into())]
        );
    }

    #[test]
    fn directories_are_refused_as_directories() {
        let sandbox = Sandbox::new();
        std::fs::create_dir(sandbox.ws.join("dir")).unwrap();
        for resolver in resolvers() {
            let workspace = sandbox.workspace(resolver);
            for path in [".", "./", "dir", "dir/", "dir/.", "./dir", "missing/", ""] {
                assert_eq!(
                    refusal(&workspace, path),
                    format!("path {path:?} names a directory, not a file")
                );
            }
        }
    }

    #[test]
    fn symbolic_links_are_never_followed() {
        let sandbox = Sandbox::new();
        let (ws, outside) = (&sandbox.ws, &sandbox.outside);
        std::fs::create_dir(ws.join("sub")).unwrap();
        symlink("../outside/target.txt", ws.join("link_file")).unwrap();
        symlink(outside.join("target.txt"), ws.join("link_abs")).unwrap();
        symlink(outside.join("by_dangling.txt"), ws.join("dangling")).unwrap();
        symlink("../../outside/target.txt", ws.join("sub/inner_link")).unwrap();
        symlink("self_loop", ws.join("self_loop")).unwrap();
        symlink(outside, ws.join("linkdir")).unwrap();
        symlink("..", ws.join("linkdir_rel")).unwrap();
        // Even a link that stays inside is refused: the refusal must not depend on where a
        // link points, which can change the moment after it is read.
        symlink("sub", ws.join("inner_dir")).unwrap();
        for resolver in resolvers() {
            let workspace = sandbox.workspace(resolver);
            for path in [
                "link_file",
                "link_abs",
                "dangling",
                "sub/inner_link",
                "self_loop",
                "linkdir",
                "linkdir/viadir.txt",
                "linkdir_rel/viaparent.txt",
                "linkdir_rel/outside/target.txt",
                "inner_dir/x.txt",
            ] {
                assert_eq!(
                    refusal(&workspace, path),
                    format!(
                        "path {path:?} contains a symbolic link; links are never followed in the workspace"
                    )
                );
            }
        }
        assert_eq!(
            sandbox.outside(),
            [("target.txt".into(), "original\n".into())]
        );
        assert!(!ws.join("sub/x.txt").exists());
    }

    #[test]
    fn missing_directories_files_taken_for_directories_and_overlong_names_are_refused() {
        let sandbox = Sandbox::new();
        std::fs::write(sandbox.ws.join("file.txt"), "").unwrap();
        let long_name = "x".repeat(5000);
        let long_path = format!("{}x", "a/".repeat(3000));
        for resolver in resolvers() {
            let workspace = sandbox.workspace(resolver);
            for (path, expected) in [
                (
                    "missing/x.txt",
                    "a directory of path \"missing/x.txt\" does not exist",
                ),
                (
                    "file.txt/x.txt",
                    "passes through a file as if it were a directory",
                ),
                (&long_name, "File name too long"),
            ] {
                let refused = refusal(&workspace, path);
                assert!(
                    refused.contains(expected),
                    "{resolver:?} {path:?}: {refused}"
                );
            }
            // The kernel refuses the whole path as too long; the walk finds no directory `a`.
            refusal(&workspace, &long_path);
        }
        assert_eq!(std::fs::read_dir(&sandbox.ws).unwrap().count(), 1);
    }

    /// Security probe F5: `append_line` on a FIFO waited forever for a reader.
    #[test]
    fn a_fifo_is_refused_at_once_instead_of_waited_on() {
        let sandbox = Sandbox::new();
        let ws = rustix::fs::open(&sandbox.ws, OFlags::PATH, Mode::empty()).unwrap();
        rustix::fs::mkfifoat(&ws, "fifo", Mode::from_raw_mode(0o600)).unwrap();
        let append_to_fifo = |resolver| {
            let workspace = sandbox.workspace(resolver);
            let (answered, answer) = mpsc::channel();
            // A thread, so that a hang fails the test instead of hanging it.
            std::thread::spawn(move || answered.send(refusal(&workspace, "fifo")));
            answer
                .recv_timeout(Duration::from_secs(5))
                .expect("the append waited on the FIFO")
        };
        for resolver in resolvers() {
            assert_eq!(
                append_to_fifo(resolver),
                "path \"fifo\" is a FIFO or socket; expected a regular file"
            );
        }
        // With a reader the open succeeds, and the file's type is what refuses it.
        let reader = rustix::fs::open(
            sandbox.ws.join("fifo"),
            OFlags::RDONLY | OFlags::NONBLOCK,
            Mode::empty(),
        )
        .unwrap();
        for resolver in resolvers() {
            assert_eq!(
                append_to_fifo(resolver),
                "path \"fifo\" is a FIFO; expected a regular file"
            );
        }
        // Every writer has closed it again, so a read ends at once: with what they wrote.
        let mut buffer = [0; 8];
        assert_eq!(
            rustix::io::read(&reader, &mut buffer),
            Ok(0),
            "nothing was written to the FIFO"
        );
    }

    /// Security probe F8: a hard link in the workspace wrote through to a file outside it.
    #[test]
    fn a_file_with_another_hard_link_is_refused() {
        let sandbox = Sandbox::new();
        std::fs::hard_link(
            sandbox.outside.join("target.txt"),
            sandbox.ws.join("hardlink"),
        )
        .unwrap();
        for resolver in resolvers() {
            assert_eq!(
                refusal(&sandbox.workspace(resolver), "hardlink"),
                "path \"hardlink\" has 2 hard links; expected a file with one (another link could be outside the workspace)"
            );
        }
        assert_eq!(
            sandbox.outside(),
            [("target.txt".into(), "original\n".into())]
        );
    }

    /// How long each resolver is raced: here, some 25,000 append attempts against 90,000
    /// swaps, of which a few hundred appends succeed; the old check-then-open let about one
    /// in ten of those land outside.
    const RACE_FOR: Duration = Duration::from_millis(1500);

    /// Security probe F1: a directory and a file swapped with links to outside while
    /// `append_line` checked and then opened them let hundreds of lines land outside.
    #[test]
    fn links_swapped_in_while_appending_never_let_a_line_out() {
        for resolver in resolvers() {
            let sandbox = Sandbox::new();
            let (ws, outside) = (&sandbox.ws, &sandbox.outside);
            std::fs::create_dir(ws.join("racedir")).unwrap();
            symlink(outside, ws.join("racedir_alt")).unwrap();
            std::fs::write(ws.join("racefile"), "").unwrap();
            symlink(outside.join("target.txt"), ws.join("racefile_alt")).unwrap();
            let workspace = sandbox.workspace(resolver);
            let stop = AtomicBool::new(false);
            let (swaps, appended, refused) = std::thread::scope(|scope| {
                let swapper = scope.spawn(|| {
                    let ws = rustix::fs::open(ws, OFlags::PATH, Mode::empty()).unwrap();
                    let mut swaps = 0_u64;
                    while !stop.load(Ordering::Relaxed) {
                        for (real, link) in
                            [("racedir", "racedir_alt"), ("racefile", "racefile_alt")]
                        {
                            rustix::fs::renameat_with(&ws, real, &ws, link, RenameFlags::EXCHANGE)
                                .unwrap();
                            swaps += 1;
                        }
                    }
                    swaps
                });
                let (mut appended, mut refused) = (0_u64, 0_u64);
                let started = Instant::now();
                while started.elapsed() < RACE_FOR {
                    for path in ["racedir/race.txt", "racefile"] {
                        match workspace.append(path, b"raced\n") {
                            Ok(()) => appended += 1,
                            Err(_) => refused += 1,
                        }
                    }
                }
                stop.store(true, Ordering::Relaxed);
                (swapper.join().unwrap(), appended, refused)
            });
            eprintln!(
                "{resolver:?}: {swaps} swaps, {appended} appends, {refused} refusals in {RACE_FOR:?}"
            );
            assert_eq!(
                sandbox.outside(),
                [("target.txt".into(), "original\n".into())],
                "{resolver:?}: a line landed outside the workspace"
            );
            assert!(
                appended >= 20 && refused >= 20 && swaps >= 1_000,
                "{resolver:?}: too little racing to mean anything: {swaps} swaps, {appended} appends, {refused} refusals"
            );
            // Every append that succeeded is in the real directory or the real file, under
            // whichever of its two names it has now.
            let real = |name: &'static str, other: &'static str| {
                if ws.join(name).is_symlink() {
                    other
                } else {
                    name
                }
            };
            let lines = |path: PathBuf| std::fs::read_to_string(path).unwrap().lines().count();
            let inside = lines(ws.join(real("racedir", "racedir_alt")).join("race.txt"))
                + lines(ws.join(real("racefile", "racefile_alt")));
            assert_eq!(inside as u64, appended, "{resolver:?}");
        }
    }
}
