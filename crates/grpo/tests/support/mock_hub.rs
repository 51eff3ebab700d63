//! A minimal Hugging Face hub on 127.0.0.1 for tests: the API's file listing of a dataset or
//! model (with `?blobs=true`, each file's git blob id and, for the large kinds of file the hub
//! keeps in LFS, its sha256), and file downloads with the headers and byte ranges hf-hub asks
//! for (`x-repo-commit`, `etag`, `Content-Range`). Serves until the test process ends. The hashes
//! are computed here with the sha1 / sha2 crates, apart from grpo's own.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;

pub const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

/// Serves dataset `id` with `files` (name, bytes); returns the endpoint URL.
#[allow(dead_code)]
pub fn serve_dataset(id: &str, files: Vec<(String, Vec<u8>)>) -> String {
    serve("datasets", id, files, &[])
}

/// The hub's hashes of `bytes`: the git blob id, and the sha256 for an LFS-kept file.
fn hashes(name: &str, bytes: &[u8]) -> serde_json::Value {
    use sha1::Digest as _;
    let mut blob = sha1::Sha1::new();
    blob.update(format!("blob {}\0", bytes.len()).as_bytes());
    blob.update(bytes);
    let mut v =
        serde_json::json!({ "rfilename": name, "blobId": format!("{:x}", blob.finalize()) });
    if [".safetensors", ".parquet", ".gguf"]
        .iter()
        .any(|e| name.ends_with(e))
    {
        v["lfs"] = serde_json::json!({
            "sha256": format!("{:x}", sha2::Sha256::digest(bytes)),
            "size": bytes.len(),
        });
    }
    v
}

/// Serves repo `id` of `kind` (`datasets` / `models`) with `files`; the listing gives the files
/// named in `lie` the hashes of other bytes (a download altered on the way).
pub fn serve(kind: &str, id: &str, files: Vec<(String, Vec<u8>)>, lie: &[&str]) -> String {
    let lie: Vec<String> = lie.iter().map(|s| s.to_string()).collect();
    let kind = kind.to_string();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let id = id.to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
            let mut range = None;
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':') {
                    if k.eq_ignore_ascii_case("range") {
                        range = v.trim().strip_prefix("bytes=").map(str::to_string);
                    }
                }
            }
            let listing = format!("/api/{kind}/{id}/revision/main");
            let blobs = format!("/api/{kind}/{id}/revision/{SHA}?blobs=true");
            let prefix = match kind.as_str() {
                "models" => format!("/{id}/resolve/{SHA}/"),
                _ => format!("/{kind}/{id}/resolve/{SHA}/"),
            };
            let (status, headers, body): (&str, Vec<String>, Vec<u8>) = if path == blobs {
                let siblings: Vec<serde_json::Value> = files
                    .iter()
                    .map(|(n, b)| match lie.contains(n) {
                        true => hashes(n, &[b.as_slice(), b"!"].concat()),
                        false => hashes(n, b),
                    })
                    .collect();
                let body = serde_json::json!({"sha": SHA, "siblings": siblings}).to_string();
                ("200 OK", vec![], body.into_bytes())
            } else if path == listing {
                let siblings: Vec<serde_json::Value> = files
                    .iter()
                    .map(|(n, _)| serde_json::json!({ "rfilename": n }))
                    .collect();
                let body = serde_json::json!({"sha": SHA, "siblings": siblings}).to_string();
                ("200 OK", vec![], body.into_bytes())
            } else if let Some((_, bytes)) = path
                .strip_prefix(&prefix)
                .and_then(|f| files.iter().find(|(n, _)| n == f))
            {
                let len = bytes.len();
                let (start, end) = match range.as_deref() {
                    Some("0-0") => (0, 0),
                    Some(r) => (r.trim_end_matches('-').parse().unwrap_or(0), len - 1),
                    None => (0, len - 1),
                };
                let etag = format!(
                    "\"{:x}\"",
                    len * 7919 + bytes.first().copied().unwrap_or(0) as usize
                );
                (
                    "206 Partial Content",
                    vec![
                        format!("ETag: {etag}"),
                        format!("X-Repo-Commit: {SHA}"),
                        format!("Content-Range: bytes {start}-{end}/{len}"),
                    ],
                    bytes[start..=end.min(len - 1)].to_vec(),
                )
            } else {
                (
                    "404 Not Found",
                    vec![],
                    b"{\"error\": \"not found\"}".to_vec(),
                )
            };
            let mut head = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            for h in headers {
                head.push_str(&h);
                head.push_str("\r\n");
            }
            head.push_str("\r\n");
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    url
}
