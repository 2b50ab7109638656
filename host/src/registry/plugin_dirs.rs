//! The directories `file` plugin sources may be read from.
//!
//! A `file` source is read with the host's own rights. Without a bound, a policy editor could
//! name any file the host can read — its service account token, a mounted Secret — and, with
//! a wrong pinned digest, read the file's hash back from the policy's status (or make the host
//! spend its load budget reading a device). So a file source must resolve, symlinks followed,
//! inside one of the directories the host was started with (`--plugin-dir`); with none, every
//! file source is refused.

use std::io;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};

/// Where file sources may be. Empty: nowhere.
#[derive(Debug, Clone, Default)]
pub struct PluginDirs {
    dirs: Vec<PathBuf>,
}

impl PluginDirs {
    /// File sources may be read from `dirs` and below (paths as given; they are resolved
    /// at each check, so a directory mounted after the host started counts).
    pub fn new(dirs: Vec<PathBuf>) -> Self {
        Self { dirs }
    }

    /// The file `path` names, resolved (relative to the working directory, symlinks
    /// followed), if it lies inside one of the directories; otherwise why not.
    ///
    /// A file that does not exist is resolved through its nearest existing ancestor, so a
    /// pinned digest can still be served from a cache after its file is gone.
    pub fn resolve(&self, path: &str) -> anyhow::Result<PathBuf> {
        if self.dirs.is_empty() {
            bail!(
                "this host reads no plugin files (it was started without --plugin-dir); use an oci, http or configMap source, or start the host with --plugin-dir"
            );
        }
        let resolved =
            resolve(Path::new(path)).with_context(|| format!("resolving plugin file {path}"))?;
        let inside = self
            .dirs
            .iter()
            .any(|dir| std::fs::canonicalize(dir).is_ok_and(|dir| resolved.starts_with(dir)));
        if !inside {
            let dirs: Vec<_> = self.dirs.iter().map(|d| d.display().to_string()).collect();
            bail!(
                "plugin file {path} (resolved: {}) is outside the directories this host reads plugins from ({}); put it in one of them, or start the host with --plugin-dir",
                resolved.display(),
                dirs.join(", ")
            );
        }
        Ok(resolved)
    }
}

/// `path` made absolute with every symlink and `..` resolved. A path that does not exist is
/// its parent resolved, joined with its last name; a `..` that cannot be resolved (its
/// directory does not exist) refuses the path, since nothing says where it would lead.
fn resolve(path: &Path) -> io::Result<PathBuf> {
    match std::fs::canonicalize(path) {
        Ok(resolved) => Ok(resolved),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            let Some(name) = path.file_name() else {
                return Err(error);
            };
            let parent = match path.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => parent,
                _ => Path::new("."),
            };
            Ok(resolve(parent)?.join(name))
        }
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(result: anyhow::Result<PathBuf>) -> String {
        match result {
            Ok(path) => panic!("{} was let through", path.display()),
            Err(error) => format!("{error:#}"),
        }
    }

    #[test]
    fn a_file_inside_a_plugin_dir_is_read_and_one_outside_is_refused_naming_the_dirs() {
        let root = tempfile::tempdir().expect("tempdir");
        let plugins = root.path().join("plugins");
        std::fs::create_dir(&plugins).expect("mkdir");
        std::fs::write(plugins.join("p.wasm"), b"p").expect("write");
        std::fs::write(root.path().join("token"), b"secret").expect("write");
        let dirs = PluginDirs::new(vec![plugins.clone()]);

        let inside = dirs
            .resolve(&plugins.join("p.wasm").display().to_string())
            .expect("inside");
        assert_eq!(
            inside,
            std::fs::canonicalize(plugins.join("p.wasm")).expect("exists")
        );

        let outside = text(dirs.resolve(&root.path().join("token").display().to_string()));
        assert!(outside.contains("outside the directories"), "{outside}");
        assert!(
            outside.contains(&plugins.display().to_string()),
            "{outside}"
        );
        // A sibling whose name starts like the directory is not inside it.
        let sibling = root.path().join("plugins-other");
        std::fs::create_dir(&sibling).expect("mkdir");
        std::fs::write(sibling.join("p.wasm"), b"p").expect("write");
        assert!(
            dirs.resolve(&sibling.join("p.wasm").display().to_string())
                .is_err()
        );
    }

    #[test]
    fn dot_dot_and_symlinks_cannot_leave_a_plugin_dir() {
        let root = tempfile::tempdir().expect("tempdir");
        let plugins = root.path().join("plugins");
        std::fs::create_dir(&plugins).expect("mkdir");
        std::fs::write(root.path().join("token"), b"secret").expect("write");
        let dirs = PluginDirs::new(vec![plugins.clone()]);

        let up = format!("{}/../token", plugins.display());
        assert!(text(dirs.resolve(&up)).contains("outside"));
        // Through a directory that does not exist, `..` leads nowhere known: refused.
        let through_missing = format!("{}/missing/../../token", plugins.display());
        assert!(dirs.resolve(&through_missing).is_err());

        std::os::unix::fs::symlink(root.path().join("token"), plugins.join("link.wasm"))
            .expect("symlink");
        let link = text(dirs.resolve(&plugins.join("link.wasm").display().to_string()));
        assert!(link.contains("outside"), "{link}");
        std::os::unix::fs::symlink(root.path(), plugins.join("up")).expect("symlink");
        let through = format!("{}/up/token", plugins.display());
        assert!(text(dirs.resolve(&through)).contains("outside"));
    }

    #[test]
    fn a_missing_file_in_a_plugin_dir_resolves_so_its_cached_digest_can_serve() {
        let root = tempfile::tempdir().expect("tempdir");
        let dirs = PluginDirs::new(vec![root.path().to_owned()]);
        let gone = root.path().join("gone.wasm");
        let resolved = dirs.resolve(&gone.display().to_string()).expect("inside");
        assert_eq!(
            resolved,
            std::fs::canonicalize(root.path())
                .expect("exists")
                .join("gone.wasm")
        );
    }

    #[test]
    fn without_plugin_dirs_every_file_is_refused() {
        let refused = text(PluginDirs::default().resolve("/p.wasm"));
        assert!(refused.contains("--plugin-dir"), "{refused}");
    }
}
