//! `cargo xtask docs`: the book under docs/, built with mdBook into target/book, then checked.
//!
//! The command-line page is written first from memprof's own definition (`memprof cli-reference`).
//! The checks: every relative link and `#anchor` in the built pages resolves (anchors are mdBook's
//! heading ids), and every `docs: PAGE.md#anchor` reference in the repository's files names a
//! page and a heading that exist, so that a renamed heading fails here, not in a reader's hands.

mod links;

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::bail;

use crate::{output, package, root, run_with, setup};

pub fn run() -> anyhow::Result<()> {
    setup::mdbook()?;
    let memprof = package::binary()?;
    let src = root().join("docs/src");
    run_with(Command::new(&memprof).arg("cli-reference").arg(src.join("reference")))?;
    let book = root().join("target/book");
    let _ = fs::remove_dir_all(&book);
    run_with(Command::new(setup::MDBOOK).args(["build", "docs"]))?;

    let pages = links::read_book(&book)?;
    let mut problems = links::broken_links(&book, &pages);
    let references = code_references()?;
    problems.extend(stale_references(&references, &pages));
    problems.extend(readme_links(&pages)?);
    if !problems.is_empty() {
        bail!("the book has {} broken links or references:\n  {}", problems.len(), problems.join("\n  "));
    }
    eprintln!(
        "xtask docs: {} pages in {}; every link and anchor resolves, and the {} `docs:` references in code",
        pages.len(),
        book.display(),
        references.len()
    );
    Ok(())
}

/// README.md's links: to a file of the repository that exists, and into the book (`docs/src/`)
/// to a page and heading that exist.
fn readme_links(pages: &BTreeMap<PathBuf, links::Page>) -> anyhow::Result<Vec<String>> {
    let readme = fs::read_to_string(root().join("README.md"))?;
    let mut broken = Vec::new();
    for (at, _) in readme.match_indices("](") {
        let rest = &readme[at + 2..];
        let href = &rest[..rest.find(')').unwrap_or(rest.len())];
        if href.contains("://") {
            continue;
        }
        let (file, anchor) = href.split_once('#').unwrap_or((href, ""));
        if !root().join(file).exists() {
            broken.push(format!("README.md: link to {href}: no {file} in the repository"));
        } else if let (Some(page), false) = (file.strip_prefix("docs/src/"), anchor.is_empty()) {
            let html = Path::new(page).with_extension("html");
            if !pages.get(&html).is_some_and(|linked| linked.has_id(anchor)) {
                broken.push(format!("README.md: link to {href}: no heading #{anchor} on that page"));
            }
        }
    }
    Ok(broken)
}

/// A `docs: PAGE.md#anchor` reference in a file of the repository.
struct Reference {
    at: String,
    page: String,
    anchor: Option<String>,
}

/// Every `docs: PAGE.md[#anchor]` in the files git knows, outside the book itself.
fn code_references() -> anyhow::Result<Vec<Reference>> {
    let files = output(Command::new("git").arg("-C").arg(root()).args(["ls-files", "-co", "--exclude-standard"]))?;
    let mut references = Vec::new();
    // This file's own examples of the syntax are not references.
    for file in files.lines().filter(|file| !file.starts_with("docs/") && *file != "xtask/src/docs.rs") {
        let Ok(text) = fs::read_to_string(root().join(file)) else { continue };
        for (number, line) in text.lines().enumerate() {
            references.extend(references_in(line).map(|(page, anchor)| Reference {
                at: format!("{file}:{}", number + 1),
                page,
                anchor,
            }));
        }
    }
    Ok(references)
}

/// The references on one line: `docs: ` followed by a page name ending in `.md`, then maybe
/// `#anchor`.
fn references_in(line: &str) -> impl Iterator<Item = (String, Option<String>)> + '_ {
    line.match_indices("docs: ").filter_map(|(start, marker)| {
        let rest = &line[start + marker.len()..];
        // Pages and mdBook's ids are lower case: `docs: PAGE.md` in prose is a placeholder.
        let end = rest
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || "/._-#".contains(c)))
            .unwrap_or(rest.len());
        let target = rest[..end].trim_end_matches('.');
        let (page, anchor) = match target.split_once('#') {
            Some((page, anchor)) => (page, Some(anchor.to_string())),
            None => (target, None),
        };
        page.ends_with(".md").then(|| (page.to_string(), anchor))
    })
}

fn stale_references(references: &[Reference], pages: &BTreeMap<PathBuf, links::Page>) -> Vec<String> {
    references
        .iter()
        .filter_map(|reference| {
            let html = Path::new(&reference.page).with_extension("html");
            let Some(linked) = pages.get(&html) else {
                return Some(format!("{}: `docs: {}`: no such page in docs/src", reference.at, reference.page));
            };
            let anchor = reference.anchor.as_ref()?;
            (!linked.has_id(anchor))
                .then(|| format!("{}: `docs: {}#{anchor}`: no such heading on that page", reference.at, reference.page))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::references_in;

    #[test]
    fn references_are_found_where_comments_put_them() {
        let found: Vec<_> =
            references_in("// why (docs: daemon/securing.md#the-listener). And docs: install.md.").collect();
        assert_eq!(
            found,
            [("daemon/securing.md".to_string(), Some("the-listener".to_string())), ("install.md".to_string(), None)]
        );
        assert_eq!(references_in("see the docs: it says").count(), 0);
    }
}
