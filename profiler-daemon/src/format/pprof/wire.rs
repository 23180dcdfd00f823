//! The protobuf wire format, as much of it as profile.proto uses: varints and length-delimited
//! fields, written and read.

/// Builds one message.
#[derive(Default)]
pub struct Writer {
    bytes: Vec<u8>,
}

const VARINT: u64 = 0;
const FIXED64: u64 = 1;
const LENGTH_DELIMITED: u64 = 2;
const FIXED32: u64 = 5;

impl Writer {
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.bytes.push(value as u8 | 0x80);
            value >>= 7;
        }
        self.bytes.push(value as u8);
    }

    fn key(&mut self, field: u32, wire_type: u64) {
        self.varint(u64::from(field) << 3 | wire_type);
    }

    /// An integer field; zero is the default and is left out, as protobuf does.
    pub fn uint(&mut self, field: u32, value: u64) {
        if value != 0 {
            self.key(field, VARINT);
            self.varint(value);
        }
    }

    pub fn bool(&mut self, field: u32, value: bool) {
        self.uint(field, u64::from(value));
    }

    /// A string or bytes field, written even when empty (string tables start with "").
    pub fn bytes(&mut self, field: u32, value: &[u8]) {
        self.key(field, LENGTH_DELIMITED);
        self.varint(value.len() as u64);
        self.bytes.extend_from_slice(value);
    }

    /// A repeated integer field, packed.
    pub fn packed(&mut self, field: u32, values: &[u64]) {
        let mut inner = Writer::default();
        values.iter().for_each(|&v| inner.varint(v));
        self.bytes(field, &inner.bytes);
    }

    /// A nested message.
    pub fn message(&mut self, field: u32, build: impl FnOnce(&mut Writer)) {
        let mut inner = Writer::default();
        build(&mut inner);
        self.bytes(field, &inner.bytes);
    }
}

/// A field's value as found on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    Int(u64),
    Bytes(&'a [u8]),
}

impl<'a> Value<'a> {
    pub fn int(self) -> Result<u64, WireError> {
        match self {
            Value::Int(n) => Ok(n),
            Value::Bytes(_) => Err(WireError::WrongType),
        }
    }

    pub fn bytes(self) -> Result<&'a [u8], WireError> {
        match self {
            Value::Bytes(b) => Ok(b),
            Value::Int(_) => Err(WireError::WrongType),
        }
    }

    /// A repeated integer field's values: packed (length-delimited) or a single one.
    pub fn ints(self) -> Result<Vec<u64>, WireError> {
        match self {
            Value::Int(n) => Ok(vec![n]),
            Value::Bytes(mut packed) => {
                let mut values = Vec::new();
                while !packed.is_empty() {
                    values.push(read_varint(&mut packed)?);
                }
                Ok(values)
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("the data ends inside a field")]
    Truncated,
    #[error("a varint is longer than 10 bytes")]
    LongVarint,
    #[error("unknown wire type {0}")]
    UnknownWireType(u64),
    #[error("a field has an unexpected type")]
    WrongType,
}

/// The fields of one message, in order.
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(message: &'a [u8]) -> Self {
        Self { rest: message }
    }
}

impl<'a> Iterator for Reader<'a> {
    type Item = Result<(u32, Value<'a>), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        Some(read_field(&mut self.rest))
    }
}

fn read_field<'a>(rest: &mut &'a [u8]) -> Result<(u32, Value<'a>), WireError> {
    let key = read_varint(rest)?;
    let field = (key >> 3) as u32;
    let value = match key & 7 {
        VARINT => Value::Int(read_varint(rest)?),
        LENGTH_DELIMITED => {
            let len = usize::try_from(read_varint(rest)?).map_err(|_| WireError::Truncated)?;
            Value::Bytes(take(rest, len)?)
        }
        FIXED64 => Value::Int(u64::from_le_bytes(take(rest, 8)?.try_into().expect("8 bytes"))),
        FIXED32 => Value::Int(u32::from_le_bytes(take(rest, 4)?.try_into().expect("4 bytes")).into()),
        other => return Err(WireError::UnknownWireType(other)),
    };
    Ok((field, value))
}

fn take<'a>(rest: &mut &'a [u8], len: usize) -> Result<&'a [u8], WireError> {
    if rest.len() < len {
        return Err(WireError::Truncated);
    }
    let (head, tail) = rest.split_at(len);
    *rest = tail;
    Ok(head)
}

fn read_varint(rest: &mut &[u8]) -> Result<u64, WireError> {
    let mut value = 0u64;
    for shift in (0..70).step_by(7) {
        let (&byte, tail) = rest.split_first().ok_or(WireError::Truncated)?;
        *rest = tail;
        if shift == 63 && byte > 1 {
            return Err(WireError::LongVarint);
        }
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(WireError::LongVarint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_at_every_length() {
        for value in [0, 1, 127, 128, 300, 1 << 35, u64::MAX] {
            let mut w = Writer::default();
            w.key(1, VARINT);
            w.varint(value);
            let bytes = w.into_bytes();
            let fields: Vec<_> = Reader::new(&bytes).collect::<Result<_, _>>().unwrap();
            assert_eq!(fields, [(1, Value::Int(value))]);
        }
    }

    #[test]
    fn the_known_encoding_of_150_and_nested_messages() {
        let mut w = Writer::default();
        w.uint(1, 150);
        assert_eq!(w.into_bytes(), [0x08, 0x96, 0x01], "the protobuf documentation's example");
        let mut w = Writer::default();
        w.message(3, |m| m.packed(1, &[3, 270]));
        w.bytes(6, b"");
        let bytes = w.into_bytes();
        let fields: Vec<_> = Reader::new(&bytes).collect::<Result<_, _>>().unwrap();
        assert_eq!(fields[1], (6, Value::Bytes(b"")));
        let (3, Value::Bytes(inner)) = fields[0] else { panic!("{fields:?}") };
        let (field, packed) = Reader::new(inner).next().unwrap().unwrap();
        assert_eq!((field, packed.ints().unwrap()), (1, vec![3, 270]));
    }

    #[test]
    fn damaged_input_is_an_error_not_a_panic() {
        assert_eq!(Reader::new(&[0x08]).next(), Some(Err(WireError::Truncated)));
        assert_eq!(Reader::new(&[0x0a, 0x05, 1]).next(), Some(Err(WireError::Truncated)));
        assert_eq!(Reader::new(&[0x0b]).next(), Some(Err(WireError::UnknownWireType(3))));
        assert_eq!(
            Reader::new(&[0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]).next(),
            Some(Err(WireError::LongVarint))
        );
    }
}
