//! Text from the traced processes (their names, their functions' and files' names) made safe to
//! print. Any local user names their process and functions as they like, and a terminal obeys
//! the escape sequences it is sent (retitling or clearing it); XML forbids most control
//! characters outright.

use std::borrow::Cow;

/// `text` with each control character (C0, DEL, C1; newlines and tabs too) written as `\xNN`.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.push_str(&format!("\\x{:02x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_written_out_and_the_rest_kept() {
        assert_eq!(printable("leak_here"), "leak_here");
        assert_eq!(printable("\u{1b}]0;owned\u{7}x"), "\\x1b]0;owned\\x07x");
        assert_eq!(printable("a\nb\tc\u{7f}\u{9b}é"), "a\\x0ab\\x09c\\x7f\\x9bé");
    }
}
