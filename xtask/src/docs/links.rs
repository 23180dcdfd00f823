//! The built book's pages read as mdBook writes them: the ids its headings get and the links it
//! makes. Only attributes matter here, so a scan for ` id="…"` and ` href="…"` is enough (text
//! inside pages is escaped: a quote in code is `&quot;`).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::Context as _;

/// A built page: the ids in it and the links it makes.
pub struct Page {
    ids: BTreeSet<String>,
    hrefs: Vec<String>,
}

/// Every HTML page under `book`, by its path relative to it.
pub fn read_book(book: &Path) -> anyhow::Result<BTreeMap<PathBuf, Page>> {
    let mut pages = BTreeMap::new();
    let mut dirs = vec![book.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "html") {
                let html = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
                let page =
                    Page { ids: attributes(&html, "id").into_iter().collect(), hrefs: attributes(&html, "href") };
                pages.insert(path.strip_prefix(book)?.to_path_buf(), page);
            }
        }
    }
    Ok(pages)
}

impl Page {
    pub fn has_id(&self, id: &str) -> bool {
        self.ids.contains(id)
    }
}

/// Each link of each page that leads nowhere: a file that is not in the book, or an anchor that
/// is not an id of its page. Links out of the book (a scheme, `//`) are not followed.
pub fn broken_links(book: &Path, pages: &BTreeMap<PathBuf, Page>) -> Vec<String> {
    let mut broken = Vec::new();
    for (path, page) in pages {
        for href in &page.hrefs {
            if href.starts_with("//") || href.split_once(':').is_some_and(|(scheme, _)| !scheme.contains('/')) {
                continue;
            }
            let (file, anchor) = href.split_once('#').unwrap_or((href, ""));
            let file = file.split('?').next().unwrap_or_default();
            let target = if file.is_empty() {
                path.clone()
            } else {
                normalize(&path.parent().unwrap_or(Path::new("")).join(file))
            };
            let target = if book.join(&target).is_dir() { target.join("index.html") } else { target };
            if !book.join(&target).exists() {
                broken.push(format!("{}: link to {href}: no {} in the book", path.display(), target.display()));
            } else if !anchor.is_empty() {
                match pages.get(&target) {
                    Some(linked) if linked.has_id(anchor) => {}
                    Some(_) => broken.push(format!("{}: link to {href}: no heading #{anchor} there", path.display())),
                    None => broken
                        .push(format!("{}: link to {href}: an anchor into a file that is not a page", path.display())),
                }
            }
        }
    }
    broken
}

/// `a/b/../c` as `a/c`: the book is served as files, so a link is resolved as a path.
fn normalize(path: &Path) -> PathBuf {
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::Normal(name) => parts.push(name),
            _ => {}
        }
    }
    parts.iter().collect()
}

/// The values of `name="…"` attributes in `html`, entities and percent-escapes decoded.
fn attributes(html: &str, name: &str) -> Vec<String> {
    let marker = format!("{name}=\"");
    html.match_indices(&marker)
        .filter(|(at, _)| html[..*at].ends_with(|c: char| c.is_ascii_whitespace()))
        .filter_map(|(at, _)| {
            let value = &html[at + marker.len()..];
            value.find('"').map(|end| decode(&value[..end]))
        })
        .collect()
}

fn decode(value: &str) -> String {
    let value = value
        .replace("&amp;", "&")
        .replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&#39;", "'");
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_read_only_where_they_are_attributes() {
        let html = r##"<h2 id="a-b"><a class="header" href="../x.html#a%2Db">A</a></h2><p data-id="no">href="no"</p>"##;
        assert_eq!(attributes(html, "id"), ["a-b"]);
        assert_eq!(attributes(html, "href"), ["../x.html#a-b"]);
    }

    #[test]
    fn a_missing_page_and_a_missing_anchor_are_broken() {
        let book = std::env::temp_dir().join(format!("xtask-links-{}", std::process::id()));
        fs::create_dir_all(book.join("guide")).unwrap();
        fs::write(book.join("index.html"), r##"<h1 id="top">x</h1><a href="guide/a.html#here">ok</a>"##).unwrap();
        fs::write(
            book.join("guide/a.html"),
            r##"<h1 id="here">a</h1><a href="../index.html#gone">no</a><a href="b.html">no</a><a href="https://x/">out</a><a href="#here">ok</a>"##,
        )
        .unwrap();
        let pages = read_book(&book).unwrap();
        let broken = broken_links(&book, &pages);
        fs::remove_dir_all(&book).unwrap();
        assert_eq!(broken.len(), 2, "{broken:?}");
        assert!(broken[0].contains("#gone") && broken[1].contains("b.html"), "{broken:?}");
    }
}
