//! Enums chosen by name in the config (`loss_type = "dapo"`): each variant has one name, and
//! `FromStr` refuses anything else with the list of names. The math modules declare their enums
//! with [`named_enum!`]; the config and the tests parse them the same way.

/// The names of an enum's variants, in declaration order.
pub trait Named: Sized + Copy + 'static {
    const NAMES: &'static [(&'static str, Self)];
}

/// Parses `s` as one of `T`'s names; the error lists them.
pub fn parse_named<T: Named>(s: &str) -> Result<T, String> {
    parse_choice(s, T::NAMES)
}

/// Parses `s` as one of `options`' names; the error lists them.
pub fn parse_choice<T: Copy>(s: &str, options: &[(&str, T)]) -> Result<T, String> {
    options
        .iter()
        .find(|(n, _)| *n == s)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
            format!("`{s}` is not supported; use one of: {}", names.join(", "))
        })
}

/// Declares a `Copy` enum whose variants have config names, with `Named`, `FromStr` and `name()`.
macro_rules! named_enum {
    ($(#[$m:meta])* pub enum $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name { $($(#[$vm])* $v,)* }

        impl $crate::named::Named for $name {
            const NAMES: &'static [(&'static str, Self)] = &[$(($s, $name::$v),)*];
        }

        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                $crate::named::parse_named(s)
            }
        }

        impl $name {
            /// The config name of this variant.
            pub fn name(self) -> &'static str {
                match self { $($name::$v => $s,)* }
            }
        }
    };
}
pub(crate) use named_enum;

#[cfg(test)]
mod tests {
    named_enum! {
        /// A test enum.
        pub enum Fruit {
            Apple = "apple",
            /// A doc on a variant.
            Pear = "pear",
        }
    }

    #[test]
    fn names_round_trip_and_errors_list_them() {
        assert_eq!("pear".parse::<Fruit>(), Ok(Fruit::Pear));
        assert_eq!(Fruit::Apple.name(), "apple");
        let e = "plum".parse::<Fruit>().unwrap_err();
        assert_eq!(e, "`plum` is not supported; use one of: apple, pear");
    }
}
